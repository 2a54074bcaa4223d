"""Run the faults a real job meets against ``infinity train`` and print what each one left.

Each case starts the tiny built-in GPT (state in NVMe swap files: ``--host-bytes 1MiB`` is below its
1.8 MiB of state) at world size 1 and 2, does something to it while it trains, and then checks:

- outcome: the exit code and the first words of the last stderr line;
- seconds to exit: from the fault to the launcher's exit;
- state lost: what a ``--resume`` of the save directory cannot recover (must be none): the resume must
  succeed and start at the newest checkpoint's step;
- files left behind (must be none): files under the swap directory, temporary directories in the save
  directory, and processes of the run still alive 5 s after it exited, after the case and its recovery
  run (the recovery run is the next job a user would start, which removes dead runs' swap directories).

Usage: ``python tools/fault_matrix.py [--sizes 1,2] [--cases a,b] [--markdown]``; about 8 minutes on 2 busy cores.
Needs root for the full-disk case (it mounts a small tmpfs); without it that case says so.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from hardware_note import line as hardware_line
from infinity.precision import hardware_record

REPO = Path(__file__).resolve().parents[1]
TINY = ["--model", "tiny", "--batch-size", "8", "--seq-len", "64", "--lr", "3e-3", "--no-progress",
        "--eval-every", "0", "--host-bytes", "1MiB"]
TIMEOUT_S = 5   # dist.timeout_s of the hung-rank case


@dataclass
class Row:
    case: str
    world: int
    outcome: str
    exit_s: float | None
    state_lost: str
    left: str


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                OMP_NUM_THREADS="1")


def _cli(*args) -> list:
    return [sys.executable, "-m", "infinity.cli", "train", *TINY, *args]


class Job:
    """One ``infinity train`` run in its own directory: swap, save dir, metrics, stderr."""

    def __init__(self, root: Path, nproc: int, *extra: str, save: bool = True):
        self.root, self.nproc = root, nproc
        root.mkdir(parents=True, exist_ok=True)
        self.swap, self.save, self.metrics = root / "swap", root / "save", root / "m.jsonl"
        self.err_path = root / "stderr.txt"
        where = ["--save-dir", str(self.save), "--save-every", "2"] if save else ["--no-save"]
        self.err = open(self.err_path, "w")
        self.proc = subprocess.Popen(_cli("--steps", "100000", "--nproc", str(nproc), "--metrics", str(self.metrics),
                                          "--swap-dir", str(self.swap), *where, *extra),
                                     env=_env(), stdout=subprocess.DEVNULL, stderr=self.err)
        self.pids: list = []

    def steps(self) -> int:
        return self.metrics.read_text().count("\n") if self.metrics.exists() else 0

    def wait_steps(self, n: int, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while self.steps() < n:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the run exited early: {self.stderr()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {n} steps in {timeout_s} s")
            time.sleep(0.05)
        self.pids = [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)]

    def ranks(self) -> list:
        kids = psutil.Process(self.proc.pid).children()
        named = sorted((c for c in kids if c.name().startswith("infinity-rank")), key=lambda c: c.name())
        return named or [psutil.Process(self.proc.pid)]

    def wait_exit(self, since: float, timeout_s: float = 180) -> tuple:
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None, time.monotonic() - since
        return self.proc.returncode, time.monotonic() - since

    def stderr(self) -> str:
        self.err.flush()
        return self.err_path.read_text()

    def last_line(self) -> str:
        lines = self.stderr().strip().splitlines()
        return lines[-1] if lines else ""

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.err.close()


def _alive(pids) -> list:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _recover(job: Job) -> str:
    """Resume the save directory one step past its newest checkpoint: what it could not recover."""
    from infinity.checkpoint.manifest import resolve_checkpoint_dir
    from infinity.checkpoint.tensor_file import CheckpointError

    try:
        newest = resolve_checkpoint_dir(job.save)   # `latest`, else the newest complete step
    except CheckpointError:
        return "no checkpoint"
    manifest = json.loads((newest / "manifest.json").read_text())
    next_step = manifest["client_state"]["infinity_train"]["next_step"]
    r = subprocess.run(_cli("--resume", str(job.save), "--steps", str(next_step + 1), "--swap-dir", str(job.swap),
                            "--json"), env=_env(), capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        return f"resume failed: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}"
    s = json.loads(r.stdout)
    return "none" if s["start_step"] == next_step else f"resumed at {s['start_step']}, saved {next_step}"


def _left(job: Job, extra_pids=()) -> str:
    files = [p for p in job.swap.rglob("*") if p.is_file()] if job.swap.exists() else []
    temps = [p for p in job.save.iterdir() if p.name.startswith(".")] if job.save.exists() else []
    pids = list(job.pids) + list(extra_pids)
    deadline = time.monotonic() + 5.0   # multiprocessing's resource tracker leaves a moment after its parent
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    procs = _alive(pids)
    parts = ([f"{len(files)} swap files"] if files else []) + ([f"{len(temps)} temp dirs"] if temps else []) + \
            ([f"{len(procs)} processes"] if procs else [])
    for pid in procs:
        os.kill(pid, signal.SIGKILL)
    return ", ".join(parts) or "none"


def _short(rc, line: str, n_words: int = 9) -> str:
    """``exit RC: the line's first words``, paths cut to their last part."""
    words = [w.rsplit("/", 1)[-1] if w.lstrip("'(").startswith("/") else w
             for w in line.removeprefix("infinity train: ").split()]
    return f"exit {rc}: " + " ".join(words[:n_words]) + ("..." if len(words) > n_words else "")


def _outcome(rc, job: Job) -> str:
    return _short(rc, job.last_line())


# ---------------------------------------------------------------- the cases

def case_signal(root: Path, nproc: int, sig: int) -> Row:
    job = Job(root, nproc)
    try:
        job.wait_steps(3)
        t0 = time.monotonic()
        job.proc.send_signal(sig)
        rc, exit_s = job.wait_exit(t0)
        left_now = _left(job)
        return Row(f"{signal.Signals(sig).name} to the launcher", nproc, _outcome(rc, job), exit_s, _recover(job),
                   left_now)
    finally:
        job.close()


def case_launcher_sigkill(root: Path, nproc: int) -> Row:
    job = Job(root, nproc)
    try:
        job.wait_steps(3)
        t0 = time.monotonic()
        job.proc.kill()
        job.proc.wait()
        deadline = time.monotonic() + 30
        while _alive(job.pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        exit_s = time.monotonic() - t0   # until the last rank is gone
        lost = _recover(job)             # the next run also removes the dead run's swap directory
        return Row("SIGKILL to the launcher", nproc, f"killed; ranks gone after {exit_s:.1f} s", exit_s, lost,
                   _left(job))
    finally:
        job.close()


def case_rank_sigkill(root: Path, nproc: int) -> Row:
    job = Job(root, nproc)
    try:
        job.wait_steps(3)
        t0 = time.monotonic()
        job.ranks()[-1].kill()
        rc, exit_s = job.wait_exit(t0)
        return Row("SIGKILL to the last rank", nproc, _outcome(rc, job), exit_s, _recover(job), _left(job))
    finally:
        job.close()


def case_sigstop(root: Path, nproc: int) -> Row:
    job = Job(root, nproc, "--config", _config(root, dist={"timeout_s": TIMEOUT_S, "warn_after_s": 2}))
    try:
        job.wait_steps(3)
        stopped = job.ranks()[-1]
        t0 = time.monotonic()
        stopped.suspend()
        rc, exit_s = job.wait_exit(t0, timeout_s=120)
        return Row(f"SIGSTOP to the last rank (dist.timeout_s {TIMEOUT_S})", nproc, _outcome(rc, job), exit_s,
                   _recover(job), _left(job, [stopped.pid]))
    finally:
        job.close()


def _config(root: Path, **sections) -> str:
    """The default config (state on NVMe) with ``sections`` changed, as a file for --config."""
    from infinity.train import default_config

    root.mkdir(parents=True, exist_ok=True)
    path = root / "config.json"
    path.write_text(json.dumps(default_config(root / "swap").replace(**sections).to_dict()))
    return str(path)


def case_corrupt_swap(root: Path, nproc: int) -> Row:
    # nothing host-resident and a host budget below each rank's part of the state: every step reads shards
    # back from the swap file (at world size 2 each rank's half would otherwise stay cached in 1 MiB)
    job = Job(root, nproc, "--config", _config(root, offload={"host_resident_bytes": 0}),
              "--host-bytes", "1MiB" if nproc == 1 else "400KiB")
    try:
        job.wait_steps(3)
        t0 = time.monotonic()
        for d, _, names in os.walk(job.swap):
            for n in names:
                if n.endswith(".swap"):
                    try:
                        with open(Path(d) / n, "r+b") as f:
                            data = bytearray(f.read())
                            f.seek(0)
                            f.write(bytes(b ^ 0xFF for b in data))
                    except FileNotFoundError:
                        pass
        rc, exit_s = job.wait_exit(t0)
        return Row("swap file corrupted mid-run", nproc, _outcome(rc, job), exit_s, _recover(job), _left(job))
    finally:
        job.close()


def case_corrupt_checkpoint(root: Path, nproc: int) -> Row:
    """The newest checkpoint is corrupt: --resume refuses it in one line; the one before it still resumes."""
    job = Job(root, nproc, "--keep-last", "2")
    try:
        job.wait_steps(5)
        job.proc.send_signal(signal.SIGINT)
        job.wait_exit(time.monotonic())
    finally:
        job.close()
    newest = job.save / (job.save / "latest").read_text().strip()
    shard = next(newest.rglob("unit*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[8 + int.from_bytes(data[:8], "little") + 40] ^= 0xFF
    shard.write_bytes(bytes(data))
    t0 = time.monotonic()
    r = subprocess.run(_cli("--resume", str(job.save), "--steps", "100", "--nproc", str(nproc), "--swap-dir",
                            str(job.swap)), env=_env(), capture_output=True, text=True, timeout=300)
    exit_s = time.monotonic() - t0
    outcome = _short(r.returncode, (r.stderr.strip().splitlines() or [""])[-1])
    shutil.rmtree(newest)
    (job.save / "latest").unlink()   # what a user does next: resume the one before
    return Row("--resume of a corrupt checkpoint", nproc, outcome, exit_s, _recover(job), _left(job))


def case_disk_full_at_save(root: Path, nproc: int) -> Row:
    """The save directory's disk fills mid-run: the failed saves say so, training and its state are kept,
    and once room is freed the next save goes through."""
    mnt = root / "small"
    mnt.mkdir(parents=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True).returncode:
        return Row("disk full at a save", nproc, "skipped (cannot mount a tmpfs: needs root)", None, "-", "-")
    try:
        job = Job(root, nproc, "--save-dir", str(mnt / "ck"), "--keep-last", "1")
        try:
            job.wait_steps(1)
            with open(mnt / "filler", "wb", buffering=0) as f:
                for piece in (b"\0" * 2**20, b"\0" * 4096):
                    try:
                        while f.write(piece):
                            pass
                    except OSError:
                        pass
            deadline = time.monotonic() + 120
            while "training goes on" not in job.stderr() and time.monotonic() < deadline:
                time.sleep(0.1)
            (mnt / "filler").unlink()   # room again
            n = job.steps()
            job.wait_steps(n + 3)
            t0 = time.monotonic()
            job.proc.send_signal(signal.SIGTERM)
            rc, exit_s = job.wait_exit(t0)
            job.save = mnt / "ck"
            failed = "training goes on" in job.stderr()
            outcome = f"exit {rc}: {'a save failed, training went on, later saves held' if failed else 'no failure'}"
            return Row("disk full at a save", nproc, outcome, exit_s, _recover(job), _left(job))
        finally:
            job.close()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def case_nan_config(root: Path, nproc: int) -> Row:
    root.mkdir(parents=True, exist_ok=True)
    (root / "nan.yaml").write_text("optimizer: {weight_decay: .nan}\n")
    t0 = time.monotonic()
    r = subprocess.run(_cli("--config", str(root / "nan.yaml"), "--steps", "2", "--nproc", str(nproc),
                            "--save-dir", str(root / "save"), "--swap-dir", str(root / "swap")),
                       env=_env(), capture_output=True, text=True, timeout=120)
    line = r.stderr.strip().splitlines()[-1].removeprefix("infinity train: ")
    made = [p for p in (root / "swap").rglob("*")] if (root / "swap").exists() else []
    return Row("weight_decay: .nan in the config", nproc, f"exit {r.returncode}: {line.split(': ', 1)[-1]}",
               time.monotonic() - t0, "n/a (nothing started)", f"{len(made)} files" if made else "none")


def case_planted_symlink(root: Path, nproc: int) -> Row:
    """The save directory's `latest` is a symlink to a victim file (the swap probe's names are random; the
    tests plant links at them with the randomness fixed)."""
    root.mkdir(parents=True, exist_ok=True)
    victim = root / "victim"
    victim.write_bytes(b"precious")
    swap, save = root / "swap", root / "save"
    swap.mkdir()
    save.mkdir()
    os.symlink(victim, save / "latest")
    t0 = time.monotonic()
    r = subprocess.run(_cli("--steps", "2", "--nproc", str(nproc), "--swap-dir", str(swap), "--save-dir", str(save)),
                       env=_env(), capture_output=True, text=True, timeout=300)
    intact = victim.read_bytes() == b"precious"
    outcome = f"exit {r.returncode}: victim {'untouched' if intact else 'OVERWRITTEN'}, latest replaced"
    job = Job.__new__(Job)
    job.swap, job.save, job.pids = swap, save, []
    return Row("symlink planted at the save dir's latest", nproc, outcome, time.monotonic() - t0,
               "none" if intact and r.returncode == 0 else "victim", _left(job))


CASES = [
    ("sigint", lambda root, n: case_signal(root, n, signal.SIGINT), (1, 2)),
    ("sigterm", lambda root, n: case_signal(root, n, signal.SIGTERM), (1, 2)),
    ("launcher_sigkill", case_launcher_sigkill, (1, 2)),
    ("rank_sigkill", case_rank_sigkill, (2,)),
    ("sigstop", case_sigstop, (2,)),
    ("corrupt_swap", case_corrupt_swap, (1, 2)),
    ("corrupt_checkpoint", case_corrupt_checkpoint, (1, 2)),
    ("disk_full", case_disk_full_at_save, (1, 2)),
    ("nan_config", case_nan_config, (1, 2)),
    ("planted_symlink", case_planted_symlink, (1, 2)),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,2", help="world sizes (default 1,2)")
    ap.add_argument("--cases", default=",".join(c for c, _, _ in CASES), help="comma-separated case names")
    ap.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    wanted = args.cases.split(",")
    rows = []
    with tempfile.TemporaryDirectory(prefix="infinity-faults-") as tmp:
        for name, fn, allowed in CASES:
            if name not in wanted:
                continue
            for n in sizes:
                if n not in allowed:
                    continue
                try:
                    row = fn(Path(tmp) / f"{name}-{n}", n)
                except Exception as e:   # noqa: BLE001 - one broken case must not hide the others' rows
                    row = Row(name, n, f"HARNESS ERROR: {e}"[:100], None, "?", "?")
                rows.append(row)
                print(f"  {row.case} (world {row.world}): {row.outcome}", file=sys.stderr, flush=True)
    print(hardware_line(hardware_record("cpu")))   # the seconds to exit are this machine's
    head = ("case", "world", "outcome", "s to exit", "state lost", "files left")
    table = [head] + [(r.case, str(r.world), r.outcome, "-" if r.exit_s is None else f"{r.exit_s:.1f}",
                       r.state_lost, r.left) for r in rows]
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for row in table[1:]:
            print("| " + " | ".join(cell.replace("|", "/") for cell in row) + " |")
    else:
        widths = [max(len(row[i]) for row in table) for i in range(len(head))]
        for row in table:
            print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
    bad = [r for r in rows if r.state_lost not in ("none", "-") and not r.state_lost.startswith("n/a")
           or r.left not in ("none", "-")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
