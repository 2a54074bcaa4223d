"""``infinity report``: the machine's and install's facts, as lines and as one JSON object."""

import json

from infinity.cli import main
from infinity.report import build_report, report_lines


def test_report_says_versions_devices_precision_and_native_libraries():
    """Without --dir: software versions, the CPU's bf16 flags, what precision auto picks and why (offloaded
    and not), and for each native library whether it is available or why not."""
    report = build_report()
    assert report["software"]["torch"] and report["software"]["python"]
    assert isinstance(report["devices"]["cpu"]["avx512_bf16"], bool)
    for key in ("params_offloaded", "params_not_offloaded"):
        choice = report["precision_auto"][key]
        assert choice["compute_dtype"] in ("fp32", "bf16", "fp16") and choice["reason"]
    for key in ("int8_adam_kernel", "host_block_cache"):
        lib = report["native"][key]
        assert lib["available"] or lib["reason"], lib
    assert "directory" not in report
    text = "\n".join(report_lines(report))
    assert "precision auto" in text and "int8 Adam kernel" in text


def test_report_dir_probes_the_swap_directory_and_leaves_nothing(tmp_path):
    """--dir: file system, O_DIRECT, free space and the engine's read and write rates; its file is removed."""
    report = build_report(str(tmp_path), probe_bytes=8 * 2**20)
    d = report["directory"]
    assert d["fs_type"] and isinstance(d["o_direct"], bool) and d["free_bytes"] > 0
    assert d["io"]["bytes"] == 8 * 2**20 and d["io"]["read_gbps"] > 0 and d["io"]["write_gbps"] > 0
    assert not any(tmp_path.iterdir())
    assert "O_DIRECT" in "\n".join(report_lines(report))


def test_cli_report_json_and_bad_dir(tmp_path, capsys):
    """``infinity report --json`` prints one JSON object; a --dir that is not a directory is exit 2."""
    assert main(["report", "--json", "--dir", str(tmp_path), "--bytes", "0"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["directory"]["io"] is None and out["directory"]["path"] == str(tmp_path)
    assert main(["report", "--dir", str(tmp_path / "missing")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_report_names_the_memory_grant_when_there_is_one(monkeypatch):
    """RAM is always reported; a cgroup memory grant gets a line of its own saying auto budgets follow it."""
    from infinity.store import memory_grant

    report = build_report()
    assert report["memory"]["physical_total_bytes"] > 0
    assert "RAM:" in "\n".join(report_lines(report))
    grant = memory_grant.MemoryGrant(2, "/sys/fs/cgroup/job", 6 * 2**30, 5 * 2**30)
    monkeypatch.setattr(memory_grant, "find_grant", lambda *a, **k: grant)
    report = build_report()
    assert report["memory"]["grant"]["limit_bytes"] == 6 * 2**30
    assert report["memory"]["total_bytes"] == min(6 * 2**30, report["memory"]["physical_total_bytes"])
    assert "memory grant: cgroup v2 limit 6.0GiB" in "\n".join(report_lines(report))
