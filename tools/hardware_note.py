"""The one line a benchmark under tools/ prints beside its figures to say which machine made them.

Figures from two machines never share a ratio. On a CPU without native bf16 (no ``avx512_bf16`` or
AMX) torch's bf16 matmul falls to a reference loop some 50-90x slower than fp32, so a bf16 figure from
such a CPU and one from a CPU with it differ by the instruction set, not by the code measured. Each
tool's JSON carries :func:`infinity.precision.hardware_record` under ``"hardware"``; :func:`line` says
the same in words:

    from hardware_note import line
    out["hardware"] = hw = hardware_record(device)   # after the tool has set its thread count
    print(line(hw))
"""

from __future__ import annotations

__all__ = ["line"]


def line(record: dict) -> str:
    """A :func:`infinity.precision.hardware_record` in one line: the CPU model (family / model numbers),
    bf16 native yes / no and by which flag, torch's kernel level, threads of cores, torch's version; the
    CUDA device where there is one."""
    cpu = record["cpu"]
    flags = [f for f in ("avx512_bf16", "amx_bf16") if cpu.get(f)]
    native = f"yes ({', '.join(flags)})" if flags else "no (no avx512_bf16 / amx_bf16: bf16 matmul is emulated)"
    text = (f"CPU {cpu['model']} (family {cpu.get('family')}, model {cpu.get('model_number')}), bf16 native: "
            f"{native}, torch kernels {cpu.get('torch_cpu_capability')}, {cpu.get('threads')} threads of "
            f"{cpu.get('cores')} cores, torch {record.get('torch')}")
    if cpu.get("isa_caps"):
        text += f"; kernels held by {', '.join(f'{k}={v}' for k, v in cpu['isa_caps'].items())}"
    cuda = record.get("cuda")
    if cuda:
        text += f"; CUDA {cuda['name']} (compute capability {'.'.join(str(v) for v in cuda['capability'])})"
    return text
