"""Lower layers never import higher ones: the order is docs/architecture.md's Layout and layers section."""

from __future__ import annotations

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "infinity"
# lowest first; a module may import its own layer and any lower one (DESIGN puts integrations and train side by
# side; the Trainer integration builds infinity train's LR schedule, so train sits just below)
ORDER = ["transitions", "native_build", "config", "precision", "io", "trace", "store", "optim", "schedule", "comm", "parallel", "zero",
         "initialization", "checkpoint", "estimate", "profile", "plan", "train", "integrations", "cli"]
LEAVES = {"models", "data"}   # the demo model and corpus: usable from anywhere, importing only the config
IMPORT = re.compile(r"^\s*(?:from|import) (infinity(?:\.\w+)*)", re.M)


SAME_LAYER = {"deepspeed_config": "config",   # the DeepSpeed reader sits beside config/ and builds a Config
              "deepspeed_keys": "config",     # the DeepSpeed key table the reader checks a file against
              "report": "profile"}          # infinity report reuses the profile's probes


def _layer(dotted: str) -> str:
    parts = dotted.split(".")
    return SAME_LAYER.get(parts[1], parts[1]) if len(parts) > 1 else "infinity"


def test_no_module_imports_a_higher_layer():
    rank = {name: i for i, name in enumerate(ORDER)}
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        me = _layer(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
        assert me in rank or me in LEAVES or me == "__init__", f"{path}: layer {me!r} is not in ORDER"
        for target in IMPORT.findall(path.read_text()):
            other = _layer(target)
            if other == me or "infinity" in (me, other) or me == "__init__":   # the package front: lazy imports
                continue
            if me in LEAVES:
                if other not in ("config",) and other not in LEAVES:
                    wrong.append(f"{path.name} ({me}) imports {target}")
                continue
            if other in LEAVES:
                continue
            if rank[other] > rank[me]:
                wrong.append(f"{path.relative_to(PACKAGE.parent)} ({me}) imports {target} ({other})")
    assert not wrong, "\n".join(wrong)
