"""``infinity plan``: the fastest config that fits, chosen from a measured profile (:mod:`infinity.plan`),
printed as loadable YAML with its prediction, or as JSON."""

from __future__ import annotations

import json
import sys

from infinity.cli.usage import UsageError

__all__ = ["add_parser"]


def add_parser(sub) -> None:
    """Register ``infinity plan`` and its arguments on ``sub``, the program's sub-command parsers."""
    p = sub.add_parser(
        "plan", help="pick every knob from a measured profile: the fastest config that fits, predicted and explained",
        description="Enumerate configs (stage, each tensor class's home, chunk size, overlap, activation "
                    "checkpointing, prefetch, reduce dtype), predict each from the machine's profile and the "
                    "model's measured compute, and print the fastest that fits the memory granted as loadable "
                    "YAML, with its predicted phases, peak RSS terms, bytes per tier pair and the next best "
                    "(see infinity/plan/). A request nothing fits is refused, naming the least that would run.")
    p.add_argument("--model", required=True, metavar="NAME|hf:DIR", help="as infinity train --model")
    p.add_argument("--devices", type=int, default=1, metavar="N", help="data-parallel ranks on this machine (default 1)")
    p.add_argument("--host-bytes", default=None, metavar="SIZE", help="host memory granted per rank (default: auto)")
    p.add_argument("--device-bytes", default=None, metavar="SIZE",
                   help="device memory granted per rank (default: auto; on CPU the device is RAM too)")
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="an infinity profile JSON (or its directory); default: measure a quick one now")
    p.add_argument("--tokens", type=int, default=None, metavar="T",
                   help="tokens per rank per step (default: infinity train's default batch over --devices)")
    p.add_argument("--seq-len", type=int, default=None, metavar="L", help="sequence length (default as infinity train)")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="an infinity or DeepSpeed (ds_config.json) config to plan from: its precision, optimizer, "
                        "schedule and other keys are kept, its memory budgets are the grant (unless --host-bytes / "
                        "--device-bytes), and the planner chooses stage, placement, prefetch and I/O (--fix one to "
                        "keep it)")
    p.add_argument("--param-dtype", default=None, choices=("auto", "bf16", "fp16", "fp32"),
                   help="precision.param_dtype (default: --config's, else auto: measured on this machine, "
                        "infinity.precision)")
    p.add_argument("--swap-dir", default=None, metavar="DIR", help="nvme_path of the chosen config (default ./infinity_swap)")
    p.add_argument("--fix", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="plan with this knob fixed (repeatable), e.g. --fix zero.stage=3 --fix offload.optimizer=none")
    p.add_argument("--out", default=None, metavar="FILE", help="also write the chosen config there (YAML)")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.set_defaults(run=_run_plan)


def _run_plan(args) -> int:
    import yaml

    from infinity.config import parse_size
    from infinity.plan import InfeasiblePlan, PlanInputError, describe
    from infinity.train import TrainError
    from infinity.train.auto import plan_model, request_for_model

    for flag, value in (("--devices", args.devices), ("--tokens", args.tokens), ("--seq-len", args.seq_len)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    fixed = {}
    for item in args.fix:
        key, eq, text = item.partition("=")
        if not eq:
            raise UsageError(f"--fix {item!r}: expected SECTION.KEY=VALUE, e.g. zero.stage=3")
        key = key.strip()
        fixed[key] = parse_size(text, f"--fix {key}") if key.endswith("bytes") else yaml.safe_load(text)
    base, grant = _plan_base(args.config)

    def granted(value, flag, key):   # the flag, else the config's budget; "auto": the tiers' auto
        if value is None:
            return grant.get(key)
        return None if value == "auto" else parse_size(value, flag)

    try:
        request = request_for_model(
            args.model, tokens=args.tokens, world=args.devices,
            host_bytes=granted(args.host_bytes, "--host-bytes", "host_bytes"),
            device_bytes=granted(args.device_bytes, "--device-bytes", "device_bytes"),
            swap_dir=args.swap_dir or grant.get("nvme_path"), base=base, seq_len=args.seq_len, fixed=fixed,
            param_dtype=args.param_dtype or (base.get("precision") or {}).get("param_dtype", "auto"))
        plan = plan_model(request, args.profile, None if args.json else (lambda m: print(m, file=sys.stderr)))
    except (InfeasiblePlan, PlanInputError, TrainError) as e:
        raise UsageError(str(e)) from None
    if args.out:
        with open(args.out, "w") as f:
            yaml.safe_dump(plan.config_dict(), f, sort_keys=False, default_flow_style=None)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2, default=str))
    else:
        print("\n".join(describe(plan)))
    return 0


def _plan_base(path: str | None) -> tuple:
    """``(base sections, grant)`` of ``infinity plan --config``: the sections the plan keeps (all but the tiers,
    prefetch and I/O, which it sizes; its knobs override the rest) and the config's memory budgets and swap
    directory where it gives them."""
    if path is None:
        return {}, {}
    from infinity.config import Config
    config = Config.from_file(path).to_dict()
    tiers = config["tiers"]
    grant = {k: tiers[k] for k in ("host_bytes", "device_bytes", "nvme_path") if tiers[k] not in (None, "auto")}
    return {k: v for k, v in config.items() if k not in ("tiers", "prefetch", "io")}, grant

