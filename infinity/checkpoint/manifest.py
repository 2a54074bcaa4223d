"""The checkpoint's table of contents: layout, file names, checksums, and how a directory is validated.

A checkpoint is a directory ``step_00000012/``::

    manifest.json               rank 0, written last: format, world size, stage, unit layout,
                                optimizer groups and steps, loss scaler, config, and each rank's
                                index (path, bytes, CRC-32)
    extras.safetensors          rank 0: buffers and frozen parameters (state_dict entries outside the units)
    hf_config.json              rank 0, for a transformers model: its config (consolidate writes config.json)
    rank00003/unit0005.safetensors   rank 3's shard of unit 5: master, exp_avg, exp_avg_sq (fp32, shard_numel)
    rank00003/state.json        rank 3's RNG states
    rank00003/index.json        rank 3's files with bytes and CRC-32s (per tensor for tensor files),
                                written after them

Node-local (``save_checkpoint(..., node_local=True)``: nodes that share no file system) each node's
directory holds a step directory with the same ``manifest.json`` and ``latest``, its own ranks'
``rankNNNNN/`` and, in its lowest rank's directory, a copy of the extras
(``rank00002/extras.safetensors``; the manifest's ``extras_copies`` lists those ranks). A rank that
resumes on the same nodes reads only its own node's files; loading anywhere else, or consolidating,
needs every rank's files: the nodes' directories brought together, or all of them passed
(:class:`Checkpoint` takes a list).

With tensor parallelism (``parallel.tensor = T``) ranks are numbered ``dp * T + tp`` and each
``tp`` rank's units hold its slices: the layout is the same on every ``tp`` rank (local shapes),
and ``tensor_parallel`` in the manifest records ``T`` and each split parameter's ``[dim, parts]``
(:mod:`infinity.checkpoint.tp_layout` reassembles and re-splits them for another ``T``).

:class:`Checkpoint` opens one: it checks the manifest, every path it names
(relative, inside the directory), and the indexes' checksums; data files are
verified by :meth:`Checkpoint.verify` before their first use (a tensor file's
header and just the tensors the caller will read).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from infinity.checkpoint.tensor_file import CheckpointError, TensorFileReader, crc32_file
from infinity.io.new_files import open_new

__all__ = ["FORMAT", "FORMAT_VERSION", "SHARD_TENSORS", "SCALE_SUFFIX", "BLOCK_CODE", "Checkpoint", "unit_layout", "unit_file", "rank_dir",
           "write_json", "resolve_checkpoint_dir", "step_dir_name", "STEP_DIR_RE"]

FORMAT = "infinity-checkpoint"
# 2: a unit file's moments may be bf16 (optimizer.moments: bf16, saved as stored); 3: or int8, saved as
# F8_E4M3 codes and an F32 tensor "<name>_scale" of one scale per block of 256 (SCALE_SUFFIX)
FORMAT_VERSION = 3
READS_VERSIONS = (1, 2, 3)   # 1: every shard tensor fp32 (what versions 2 and 3 write for fp32 moments)
SHARD_TENSORS = ("master", "exp_avg", "exp_avg_sq")   # TensorClass values saved per unit shard
SCALE_SUFFIX = "_scale"
BLOCK_CODE = "F8_E4M3"   # the saved dtype of int8 moments' codes; each such tensor has its scales beside it
STEP_DIR_RE = re.compile(r"^step_(\d{8,})$")
_MAX_JSON_BYTES = 256 * 2**20


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def rank_dir(rank: int) -> str:
    return f"rank{rank:05d}"


def unit_file(rank: int, unit_index: int) -> str:
    return f"{rank_dir(rank)}/unit{unit_index:04d}.safetensors"


def unit_layout(units: list, model) -> list:
    """JSON-able layout of the engine's units; every name of a tied parameter is listed under its slot."""
    names_of: dict = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    out = []
    for u in units:
        slots = [{"name": s.name, "names": names_of[id(p)], "shape": list(s.shape), "offset": s.offset,
                  "numel": s.numel, "group_index": s.group_index} for s, p in zip(u.slots, u.params)]
        out.append({"name": u.name, "numel": u.numel, "padded_numel": u.padded_numel,
                    "shard_numel": u.shard_numel, "slots": slots})
    return out


def write_json(path, obj) -> tuple:
    """Write, flush and fsync a JSON file; returns its index entry ``{"bytes", "crc32"}``."""
    data = json.dumps(obj, indent=1).encode()
    try:
        with open_new(path, "wb", 0o644) as f:   # new: a planted symlink is refused, never followed
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise CheckpointError(f"writing {path} failed: {e.strerror or e} (errno {e.errno})") from e
    nbytes, crc = crc32_file(path)
    return {"bytes": nbytes, "crc32": crc}


def resolve_checkpoint_dir(path) -> Path:
    """A step directory (holds manifest.json), or a root: its ``latest``, else its newest complete step."""
    path = Path(path)
    if (path / "manifest.json").is_file():
        return path
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path}: no such directory")
    latest = path / "latest"
    if latest.is_file():
        name = latest.read_text().strip()
        if not STEP_DIR_RE.match(name):
            raise CheckpointError(f"checkpoint {path}: {latest} names {name!r}, not a step directory")
        if (path / name / "manifest.json").is_file():
            return path / name
    steps = sorted((int(m.group(1)), d) for d in path.iterdir()
                   if (m := STEP_DIR_RE.match(d.name)) and (d / "manifest.json").is_file())
    if not steps:
        raise CheckpointError(f"checkpoint {path}: no complete checkpoint here (no manifest.json, no step_* "
                              "directory with one)")
    return steps[-1][1]


def _file_entry(meta: dict) -> dict:
    """An index entry with its numbers checked: a tensor file's header and per-tensor CRCs, or a whole-file CRC."""
    if "tensors" in meta:
        return {"bytes": int(meta["bytes"]), "header_crc32": int(meta["header_crc32"]),
                "tensors": {str(k): int(v) for k, v in meta["tensors"].items()}}
    return {"bytes": int(meta["bytes"]), "crc32": int(meta["crc32"])}


class Checkpoint:
    """A validated checkpoint directory (read side)."""

    tp_size = 1   # saved tensor-parallel ways (set from the manifest; 1 for checkpoints without TP)

    def __init__(self, path):
        """``path``: a step directory or a root (its latest step); or a list of them, one per node of a
        node-local checkpoint (the same step), each rank's files taken from whichever holds them."""
        paths = list(path) if isinstance(path, (list, tuple)) else [path]
        if not paths:
            raise CheckpointError("checkpoint: no directory given")
        dirs = [resolve_checkpoint_dir(p) for p in paths]
        self.dir, self.dirs = dirs[0], dirs
        self._root = os.path.realpath(self.dir)
        self._rank_root: dict = {}    # rank -> the directory holding its files (node-local: its node's)
        self.absent_ranks: list = []  # node-local: ranks whose node's directory was not given
        self.manifest = self._read_json("manifest.json", "the manifest", rank=None)
        for d in dirs[1:]:
            if (d / "manifest.json").read_bytes() != (self.dir / "manifest.json").read_bytes():
                raise CheckpointError(f"checkpoint directories {self.dir} and {d} hold different checkpoints (their "
                                      "manifests differ); pass the same step of one run from every node")
        m = self.manifest
        if not isinstance(m, dict) or m.get("format") != FORMAT:
            raise CheckpointError(f"{self.dir / 'manifest.json'}: not an {FORMAT} manifest")
        if m.get("format_version") not in READS_VERSIONS:
            raise CheckpointError(f"{self.dir / 'manifest.json'}: format version {m.get('format_version')!r}, "
                                  f"this version of infinity reads {', '.join(map(str, READS_VERSIONS[:-1]))} "
                                  f"and {READS_VERSIONS[-1]}")
        for key in ("world_size", "stage", "shard_world", "units", "ranks", "optimizer", "state_dict_keys"):
            if key not in m:
                raise CheckpointError(f"{self.dir / 'manifest.json'}: missing key {key!r}")
        try:
            self.world_size, self.shard_world = int(m["world_size"]), int(m["shard_world"])
            self.units = m["units"]
            for u in self.units:
                if int(u["shard_numel"]) < 1 or int(u["shard_numel"]) * self.shard_world < int(u["numel"]):
                    raise ValueError(f"unit {u['name']!r}: {self.shard_world} shards of {u['shard_numel']} "
                                     f"elements cannot hold {u['numel']}")
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{self.dir / 'manifest.json'}: malformed unit layout ({e})") from None
        if len(m["ranks"]) != self.world_size:
            raise CheckpointError(f"{self.dir / 'manifest.json'}: lists {len(m['ranks'])} ranks, world size "
                                  f"{self.world_size}")
        tp = m.get("tensor_parallel") or {}
        self.tp_size = int(tp.get("size", 1))                  # saved tensor-parallel ways
        self.tp_specs = {n: (int(d), int(k)) for n, (d, k) in tp.get("specs", {}).items()}
        if self.world_size % self.tp_size:
            raise CheckpointError(f"{self.dir / 'manifest.json'}: tensor_parallel size {self.tp_size} does not "
                                  f"divide world size {self.world_size}")
        self.node_local = bool(m.get("node_local", False))
        for r, entry in enumerate(m["ranks"]):
            rel = entry.get("index") if isinstance(entry, dict) else None
            if not isinstance(rel, str):
                raise CheckpointError(f"{self.dir / 'manifest.json'}: rank {r}'s entry {entry!r} lacks index/bytes/crc32")
            found = next((d for d in dirs if self._inside(os.path.realpath(d), rel, r).is_file()), None)
            if found is not None:
                self._rank_root[r] = os.path.realpath(found)
            elif self.node_local:
                self.absent_ranks.append(r)
            else:
                raise CheckpointError(f"checkpoint {self.dir}: rank {r}'s index {rel} is missing (the checkpoint "
                                      f"was saved at world size {self.world_size}; every rank's files are needed)")
        self.files: dict = {}       # relative path -> (rank, index entry)
        for r, entry in enumerate(m["ranks"]):
            if r in self._rank_root:
                self._read_index(r, entry)
        self._verified: set = set()   # (path, None) for whole files and headers, (path, tensor) for tensors

    def _absent(self, rank: int, what: str) -> CheckpointError:
        """A node-local checkpoint's rank whose node's directory was not given."""
        where = ", ".join(map(str, self.dirs))
        return CheckpointError(f"checkpoint {where}: {what} of rank {rank} is not here: the checkpoint was saved "
                               f"node-local (each node wrote its own ranks' files) and rank {rank}'s node's "
                               "directory was not given; copy the nodes' step directories into one, or pass every "
                               "node's directory")

    def extras_source(self) -> tuple:
        """(relative path, rank) of a copy of the extras (buffers, frozen parameters) found here: rank 0's,
        or (node-local) another node's lowest rank's."""
        for r in self.manifest.get("extras_copies") or [0]:
            if r in self._rank_root:
                return ("extras.safetensors" if r == 0 else f"{rank_dir(r)}/extras.safetensors"), r
        raise self._absent(0, "the extras (buffers and frozen parameters)")

    def _read_index(self, r: int, entry) -> None:
        """Check rank r's index against the manifest, then take its file entries (paths checked)."""
        where = self.dir / "manifest.json"
        try:
            rel, meta = entry["index"], {"bytes": int(entry["bytes"]), "crc32": int(entry["crc32"])}
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{where}: rank {r}'s entry {entry!r} lacks index/bytes/crc32") from None
        path = self.path(rel, rank=r)
        self._check_file(rel, r, meta)
        index = self._read_json(rel, "index", rank=r)
        try:
            listed = {frel: _file_entry(fmeta) for frel, fmeta in index["files"].items()}
        except (KeyError, TypeError, ValueError, AttributeError):
            raise CheckpointError(f"{path} (rank {r}): index entries lack bytes and CRC-32s") from None
        for frel, fmeta in listed.items():
            self.path(frel, rank=r)
            self.files[frel] = (r, fmeta)

    # ------------------------------------------------------------ paths and checks

    def path(self, rel: str, rank: int | None = None) -> Path:
        """``rel`` under the checkpoint (``rank``'s directory); refuses absolute paths and anything resolving
        outside it."""
        if rank is not None and rank in self.absent_ranks:
            raise self._absent(rank, f"file {rel}")
        return self._inside(self._rank_root.get(rank, self._root), rel, rank)

    def _inside(self, root: str, rel: str, rank: int | None) -> Path:
        """``rel`` under the real path ``root``; refuses absolute paths and anything resolving outside it."""
        who = f" (rank {rank})" if rank is not None else ""
        if not isinstance(rel, str) or not rel or os.path.isabs(rel):
            raise CheckpointError(f"checkpoint {self.dir}{who}: path {rel!r} is not relative to the checkpoint")
        full = os.path.realpath(os.path.join(root, rel))
        if not full.startswith(root + os.sep):
            raise CheckpointError(f"checkpoint {self.dir}{who}: path {rel!r} leaves the checkpoint directory")
        return Path(full)

    def _read_json(self, rel: str, what: str, rank):
        path = self.path(rel, rank)
        who = f" (rank {rank})" if rank is not None else ""
        try:
            if path.stat().st_size > _MAX_JSON_BYTES:
                raise CheckpointError(f"{path}{who}: {what} is {path.stat().st_size} bytes, too large")
            return json.loads(path.read_bytes())
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {self.dir}{who}: {what} {rel} is missing") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}{who}: {what} is not valid JSON ({e})") from None

    def _corrupt(self, path, rank: int, detail: str) -> CheckpointError:
        return CheckpointError(f"checkpoint file {path} (written by rank {rank}) is corrupt: {detail}")

    def _check_file(self, rel: str, rank: int, meta: dict) -> None:
        path = self.path(rel, rank)
        try:
            got_bytes, got_crc = crc32_file(path)
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {self.dir}: rank {rank}'s file {rel} is missing") from None
        if got_bytes != meta["bytes"] or got_crc != meta["crc32"]:
            raise self._corrupt(path, rank, f"{got_bytes} bytes, CRC-32 {got_crc:08x}; its index says "
                                            f"{meta['bytes']} bytes, CRC-32 {meta['crc32']:08x}")

    def _check_tensors(self, rel: str, rank: int, meta: dict, tensors) -> None:
        path = self.path(rel, rank)
        todo = [t for t in (meta["tensors"] if tensors is None else tensors) if (rel, t) not in self._verified]
        if not todo and (rel, None) in self._verified:
            return
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {self.dir}: rank {rank}'s file {rel} is missing") from None
        if size != meta["bytes"]:
            raise self._corrupt(path, rank, f"{size} bytes, its index says {meta['bytes']}")
        try:
            reader = TensorFileReader(path, f"checkpoint file written by rank {rank}")
        except CheckpointError as e:
            raise self._corrupt(path, rank, str(e)) from None
        with reader:
            if reader.header_crc32 != meta["header_crc32"]:
                raise self._corrupt(path, rank, f"header CRC-32 {reader.header_crc32:08x}, its index says "
                                                f"{meta['header_crc32']:08x}")
            self._verified.add((rel, None))
            for t in todo:
                if t not in meta["tensors"]:
                    raise CheckpointError(f"{path} (rank {rank}): its index lists no tensor {t!r}")
                got = reader.tensor_crc32(t)
                if got != meta["tensors"][t]:
                    raise self._corrupt(path, rank, f"tensor {t!r} CRC-32 {got:08x}, its index says "
                                                    f"{meta['tensors'][t]:08x}")
                self._verified.add((rel, t))

    def rank_of(self, rel: str, expected_rank: int) -> int:
        if rel not in self.files and expected_rank in self.absent_ranks:
            raise self._absent(expected_rank, f"file {rel}")
        if rel not in self.files:
            raise CheckpointError(f"checkpoint {self.dir}: rank {expected_rank}'s file {rel} is missing from its "
                                  f"index (the checkpoint was saved at world size {self.world_size})")
        return self.files[rel][0]

    def saved_tensors(self, names=SHARD_TENSORS) -> tuple:
        """``names`` and, for each saved as int8 codes, its scale tensor: what reading them reads."""
        dtypes = self.manifest.get("shard_tensor_dtypes") or {}
        return tuple(names) + tuple(n + SCALE_SUFFIX for n in names if dtypes.get(n) == BLOCK_CODE)

    def verify(self, rel: str, expected_rank: int, tensors=None) -> Path:
        """Path of a listed file, checked once per Checkpoint: whole, or (a tensor file) its header and
        ``tensors`` (None: all of them)."""
        rank = self.rank_of(rel, expected_rank)
        meta = self.files[rel][1]
        if "tensors" in meta:
            self._check_tensors(rel, rank, meta, tensors)
        elif (rel, None) not in self._verified:
            self._check_file(rel, rank, meta)
            self._verified.add((rel, None))
        return self.path(rel, rank)

    # ------------------------------------------------------------ layout

    def unit_sources(self, unit_index: int, lo: int, hi: int, tp_rank: int = 0) -> list:
        """Where unpadded elements [lo, hi) of ``tp_rank``'s unit live: (rank, file, local_lo, local_hi, out_lo)
        pieces (dp shard ``s`` of tp rank ``t`` was written by rank ``s * T + t``)."""
        shard_numel = int(self.units[unit_index]["shard_numel"])
        pieces, e = [], lo
        while e < hi:
            s = e // shard_numel
            end = min(hi, (s + 1) * shard_numel)
            r = s * self.tp_size + tp_rank
            pieces.append((r, unit_file(r, unit_index), e - s * shard_numel, end - s * shard_numel, e - lo))
            e = end
        return pieces

    def check_layout(self, layout: list, num_groups: int) -> None:
        """The unit layout must match the saved one (padding and shard sizes may differ)."""
        where = f"checkpoint {self.dir}"
        if len(layout) != len(self.units):
            raise CheckpointError(f"{where}: saved with {len(self.units)} units, the model has {len(layout)}; "
                                  "build the same model (and zero.unit_classes) as when saving")
        for mine, saved in zip(layout, self.units):
            if mine["name"] != saved["name"] or mine["numel"] != saved["numel"]:
                raise CheckpointError(f"{where}: unit {saved['name']!r} ({saved['numel']} elements) vs the model's "
                                      f"{mine['name']!r} ({mine['numel']} elements)")
            for a, b in zip(mine["slots"], saved["slots"]):
                keys = ("name", "shape", "offset", "numel", "group_index")
                if any(a[k] != b[k] for k in keys):
                    raise CheckpointError(
                        f"{where}: unit {saved['name']!r} parameter {b['name']!r} shape {b['shape']} group "
                        f"{b['group_index']} vs the model's {a['name']!r} shape {a['shape']} group {a['group_index']}")
            if len(mine["slots"]) != len(saved["slots"]):
                raise CheckpointError(f"{where}: unit {saved['name']!r} has {len(saved['slots'])} parameters, the "
                                      f"model's {len(mine['slots'])}")
        saved_groups = len(self.manifest["optimizer"]["param_groups"])
        if saved_groups != num_groups:
            raise CheckpointError(f"{where}: saved with {saved_groups} param groups, the optimizer has {num_groups}")

