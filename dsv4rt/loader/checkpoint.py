"""A checkpoint folder: config.json plus one or more safetensors files, seen through official tensor names."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from ..config import ModelConfig
from ..files import load_json, read_regular
from .formats import dequant_fp4, dequant_fp8, fp4_scale_shape, fp8_scale_shape
from .names import expected_shapes, scale_name, to_official
from .safetensors import CheckpointError, SafetensorsFile

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
_FLOATS = {"F64", "F32", "F16", "BF16"}
_INTS = {"I64", "I32", "I16", "I8", "U8"}
_SCALES = {"F8_E8M0", "U8", "F32", "BF16", "F16"}
_LAYER = re.compile(r"^layers\.(\d+)\.")


class Checkpoint:
    def __init__(self, root: Path, config: ModelConfig, files: list[SafetensorsFile],
                 table: dict[str, tuple[SafetensorsFile, str]]):
        self.root, self.config, self._files, self._table = root, config, files, table

    @classmethod
    def open(cls, model_dir: str | Path) -> "Checkpoint":
        root = Path(model_dir)
        if not root.is_dir():
            raise CheckpointError(f"checkpoint folder {root} does not exist" if not root.exists()
                                  else f"checkpoint path {root} is not a folder")
        cfg = ModelConfig.load(root)
        files: list[SafetensorsFile] = []
        try:
            table = {}
            for path, wanted in _shards(root):
                f = SafetensorsFile(path)
                files.append(f)
                for stored in wanted if wanted is not None else f.tensors:
                    if stored not in f.tensors:
                        raise CheckpointError(f"checkpoint {root}: the index puts {stored!r} in {path.name}, "
                                              "which does not hold it")
                    _add(table, root, cfg, f, stored)
            return cls(root, cfg, files, table)
        except BaseException:
            for f in files:
                f.close()
            raise

    def names(self) -> list[str]:
        """Official names of every stored tensor, block scales included."""
        return sorted(self._table)

    def stored_dtype(self, name: str) -> str:
        return self._info(name).dtype

    def quant_format(self, name: str) -> str | None:
        """'fp8' (e4m3 + block scales), 'fp4' (packed e2m1 + block scales) or None."""
        dtype = self.stored_dtype(name)
        if not name.endswith(".weight"):
            return None
        return "fp8" if dtype == "F8_E4M3" else "fp4" if dtype in ("I8", "U8") else None

    def is_quantized(self, name: str) -> bool:
        return self.quant_format(name) is not None

    def raw(self, name: str) -> np.ndarray:
        """The stored tensor as a read-only view of the mapped file."""
        f, stored = self._slot(name)
        return f.array(stored)

    def logical_shape(self, name: str) -> tuple[int, ...]:
        shape = self._info(name).shape
        if self.quant_format(name) == "fp4" and len(shape) == 2:
            return shape[0], 2 * shape[1]
        return shape

    def float32(self, name: str) -> np.ndarray:
        """The tensor dequantised to float32, in its logical shape."""
        fmt = self.quant_format(name)
        if fmt is None:
            return self.raw(name).astype(np.float32)
        decode = dequant_fp8 if fmt == "fp8" else dequant_fp4
        scale = self.raw(self._scale_of(name, fmt))
        try:
            return decode(self.raw(name), scale)
        except ValueError as e:
            raise CheckpointError(f"checkpoint {self.root}: {name}: {e}") from None

    def validate(self):
        """Check the weights against the config; raises CheckpointError with one line on the first kind of fault."""
        want = expected_shapes(self.config)
        missing = [n for n in want if n not in self._table]
        if missing:
            raise CheckpointError(f"checkpoint {self.root} is missing {_tensors(missing)}: {', '.join(missing)}")
        wrong = [f"{n} is {list(self.logical_shape(n))}, config implies {list(s)}"
                 for n, s in want.items() if self.logical_shape(n) != s]
        if wrong:
            more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
            raise CheckpointError(f"config disagrees with weights: {wrong[0]}{more}")
        for n in want:
            self._check_storage(n)
        known = set(want) | {scale_name(n) for n in want if self.is_quantized(n)}
        extra = [n for n in self.names() if n not in known]
        if extra:
            shown = ", ".join(extra[:10]) + (", ..." if len(extra) > 10 else "")
            raise CheckpointError(f"checkpoint {self.root} holds {_tensors(extra)} the config does not expect: {shown}")

    def close(self):
        for f in self._files:
            f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _slot(self, name: str) -> tuple[SafetensorsFile, str]:
        try:
            return self._table[name]
        except KeyError:
            raise CheckpointError(f"checkpoint {self.root} has no tensor {name!r}") from None

    def _info(self, name: str):
        f, stored = self._slot(name)
        return f.tensors[stored]

    def _scale_of(self, name: str, fmt: str) -> str:
        s = scale_name(name)
        if s not in self._table:
            raise CheckpointError(f"checkpoint {self.root}: {fmt} weight {name} has no scale tensor {s}")
        return s

    def _check_storage(self, n: str):
        dtype, where = self.stored_dtype(n), f"checkpoint {self.root}: {n}"
        fmt = self.quant_format(n)
        if fmt:
            s = self._scale_of(n, fmt)
            shape = self.logical_shape(n)
            need = fp8_scale_shape(shape) if fmt == "fp8" else fp4_scale_shape(shape)
            if self.stored_dtype(s) not in _SCALES or self._info(s).shape != need:
                raise CheckpointError(f"{where} needs a scale of {list(need)} in e8m0 or float, "
                                      f"found {self.stored_dtype(s)} {list(self._info(s).shape)}")
        elif n.endswith(".tid2eid"):
            if dtype not in _INTS:
                raise CheckpointError(f"{where} must hold integers, found {dtype}")
            ids = self.raw(n)
            if ids.size and not (0 <= ids.min() and ids.max() < self.config.n_experts):
                raise CheckpointError(f"{where} holds expert ids outside [0, {self.config.n_experts})")
        elif dtype not in _FLOATS:
            raise CheckpointError(f"{where} must be a float tensor, found {dtype}")


def _tensors(names: list) -> str:
    return f"{len(names)} tensor{'s' * (len(names) != 1)}"


def _add(table: dict, root: Path, cfg: ModelConfig, f: SafetensorsFile, stored: str):
    name = to_official(stored)
    m = _LAYER.match(name or "")
    # some exports number the MTP layers after the main ones; like mtp.*, the runtime skips them
    if name is None or (m and cfg.num_layers <= int(m[1]) < cfg.num_layers + cfg.n_mtp):
        return
    if name in table:
        g, other = table[name]
        raise CheckpointError(f"checkpoint {root}: {other!r} ({g.path.name}) and {stored!r} ({f.path.name}) "
                              f"are both {name!r}")
    table[name] = (f, stored)


def _shards(root: Path) -> list[tuple[Path, list[str] | None]]:
    """Files to open, each with the tensors to take from it (None: all of them)."""
    # exists(), not is_file(): a FIFO or folder of these names is opened, and refused there in one line
    if (root / SINGLE).exists():
        return [(root / SINGLE, None)]
    if (root / INDEX).exists():
        return _index(root)
    found = sorted(root.glob("*.safetensors"))
    if not found:
        raise CheckpointError(f"checkpoint {root} has no {SINGLE}, no {INDEX} and no *.safetensors")
    return [(p, None) for p in found]


def _index(root: Path) -> list[tuple[Path, list[str]]]:
    where = root / INDEX
    text = read_regular(where, CheckpointError)
    try:
        index = load_json(text)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError, JSONDecodeError, json_int's
        raise CheckpointError(f"{where}: cannot read the index ({str(e).splitlines()[0]})") from None
    wmap = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
        raise CheckpointError(f"{where}: needs a 'weight_map' object of tensor name -> shard file")
    by_name: dict[str, list[str]] = {}
    for name, shard in wmap.items():
        by_name.setdefault(shard, []).append(name)
    by_path: dict[Path, list[str]] = {}  # two spellings of one shard must not open it twice
    for shard, names in by_name.items():
        by_path.setdefault(_shard_path(root, shard, where).resolve(), []).extend(names)
    return list(by_path.items())


def _shard_path(root: Path, shard: str, where: Path) -> Path:
    p = Path(shard)
    path = root / p
    if p.is_absolute() or ".." in p.parts or not path.resolve().is_relative_to(root.resolve()):
        raise CheckpointError(f"{where}: shard {shard!r} lies outside the checkpoint folder")
    if not path.exists():
        raise CheckpointError(f"{where}: shard {shard!r} does not exist")
    return path
