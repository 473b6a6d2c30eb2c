"""Reading a Hugging Face checkpoint folder: config.json, generation_config.json and the safetensors weights.

Only headers are read up front. Tensor data is read on demand, one tensor or a few rows of one at a time, through
`safetensors.safe_open(..., framework="numpy")`; the file is closed after every read because safetensors maps it
into memory, and the pages a read touched would otherwise stay resident until the end of the export.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import safe_open

from ..checkpoint import NUMPY_DTYPES
from ..errors import CheckpointError, UnsupportedModelError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# safetensors dtype code -> our dtype name, for the dtypes a source checkpoint may use for plain weights.
SOURCE_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
# safetensors dtype code -> NumPy dtype of every dtype the exporter reads: the plain ones, then those of quantized
# weights (export/quantized_sources.py): fp8 e4m3 values, packed int4 codes, shapes and zero points.
STORED_DTYPES = {**{code: NUMPY_DTYPES[name] for code, name in SOURCE_DTYPES.items()},
                 "F8_E4M3": NUMPY_DTYPES["float8_e4m3fn"], "I32": np.dtype("<i4"), "I64": np.dtype("<i8"),
                 "I8": NUMPY_DTYPES["int8"], "U8": NUMPY_DTYPES["uint8"]}
# Dtypes safetensors' NumPy reader cannot give (NumPy has no float8): their bytes are read from the file.
_RAW_DTYPES = ("F8_E4M3",)


@dataclass(frozen=True)
class TensorInfo:
    """Where one checkpoint tensor lives, with its header dtype and shape."""

    file: Path
    dtype: str  # safetensors code: "BF16", "F16", "F32", ...
    shape: tuple[int, ...]

    offset: int  # of the tensor's first byte in the file

    @property
    def nbytes(self) -> int:
        """The tensor's bytes (0 for a dtype the exporter does not read, which the plan refuses by name)."""
        dtype = STORED_DTYPES.get(self.dtype)
        return int(np.prod(self.shape)) * dtype.itemsize if dtype is not None else 0


def read_json(path: Path) -> dict:
    """A JSON object from a file, or CheckpointError naming the file."""
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise CheckpointError(f"cannot read {path} ({exc.strerror})") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} does not hold a JSON object")
    return data


class HFCheckpoint:
    """A Hugging Face model folder: its raw config dicts and the headers of its safetensors weights."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise CheckpointError(f"{self.folder} is not a directory")
        config_path = self.folder / "config.json"
        if not config_path.is_file():
            raise CheckpointError(f"config.json is missing from {self.folder}")
        self.config = read_json(config_path)
        generation_path = self.folder / "generation_config.json"
        self.generation_config = read_json(generation_path) if generation_path.is_file() else {}
        self._weight_map: dict[str, str] | None = None  # the index's tensor -> shard file, when sharded
        self.tensors = self._read_headers()
        self._check_weight_map()

    def _weight_files(self) -> list[Path]:
        """model.safetensors, else the shards its index lists: transformers' order, so both read the same weights
        from a folder that holds both (a leftover index, or a single-file copy of a sharded upload)."""
        if (self.folder / SINGLE_FILE).is_file():
            return [self.folder / SINGLE_FILE]
        index_path = self.folder / INDEX_FILE
        if index_path.is_file():
            weight_map = read_json(index_path).get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise CheckpointError(f"{index_path} has no valid weight_map")
            for name in set(weight_map.values()):
                if Path(name).name != name or name in ("", ".", ".."):
                    raise CheckpointError(f"{INDEX_FILE} lists {name!r}, which is not a file name in the model folder")
            self._weight_map = weight_map
            files = [self.folder / name for name in sorted(set(weight_map.values()))]
            for path in files:
                if not path.is_file():
                    raise CheckpointError(f"{INDEX_FILE} lists {path.name}, which is missing from {self.folder}")
            return files
        if any(self.folder.glob("*.bin")) or any(self.folder.glob("*.pt")) or any(self.folder.glob("*.pth")):
            raise UnsupportedModelError(
                f"{self.folder} holds PyTorch pickle weights only; Colibri reads safetensors "
                "(load the model with transformers and save_pretrained it to convert)"
            )
        raise CheckpointError(f"{self.folder} has no {SINGLE_FILE} or {INDEX_FILE}")

    def _read_headers(self) -> dict[str, TensorInfo]:
        tensors: dict[str, TensorInfo] = {}
        for path in self._weight_files():
            try:
                with safe_open(str(path), framework="numpy") as f:
                    offsets = _data_offsets(path)
                    for name in f.keys():
                        view = f.get_slice(name)
                        if name in tensors:
                            raise CheckpointError(f"tensor {name} is in both {tensors[name].file.name} and {path.name}")
                        tensors[name] = TensorInfo(path, view.get_dtype(), tuple(view.get_shape()), offsets[name])
            except CheckpointError:
                raise
            except Exception as exc:  # safetensors raises its own error types for a bad header
                raise CheckpointError(f"{path.name} is truncated or not a safetensors file ({exc})") from None
        return tensors

    def _check_weight_map(self) -> None:
        """Every tensor the index lists is in the shard it names: a stale index or a wrong shard is refused."""
        if self._weight_map is None:
            return
        for name, file in sorted(self._weight_map.items()):
            info = self.tensors.get(name)
            if info is None or info.file.name != file:
                where = f"it is in {info.file.name}" if info else "no shard holds it"
                raise CheckpointError(f"{INDEX_FILE} places {name} in {file}, but {where}")

    def read(self, name: str, index: tuple = ()) -> np.ndarray:
        """`tensor[index]` in its stored dtype; only the bytes of the selected rows are read."""
        info = self.tensors[name]
        file = info.file
        if info.dtype in _RAW_DTYPES:
            return self._read_raw(name)[index] if index else self._read_raw(name)
        try:
            with safe_open(str(file), framework="numpy") as f:
                return f.get_slice(name)[index] if index else f.get_tensor(name)
        except OSError:
            raise  # the exporter reports it with the file name
        except Exception as exc:  # the file changed or broke since its header was read
            raise CheckpointError(f"cannot read {name} from {file.name} ({exc})") from None

    def _read_raw(self, name: str) -> np.ndarray:
        """A whole tensor of a dtype NumPy's safetensors reader lacks, from its bytes in the file."""
        info = self.tensors[name]
        dtype = STORED_DTYPES[info.dtype]
        count = int(np.prod(info.shape))
        with open(info.file, "rb") as f:
            f.seek(info.offset)
            data = np.fromfile(f, np.uint8, count * dtype.itemsize)
        if data.size != count * dtype.itemsize:
            raise CheckpointError(f"cannot read {name} from {info.file.name} (the file ends inside it)")
        return data.view(dtype).reshape(info.shape)


def _data_offsets(path: Path) -> dict[str, int]:
    """Each tensor's first byte in a safetensors file: after the 8-byte header length and the JSON header, at the
    header's data_offsets[0] (safe_open has read and checked the same header)."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    return {name: 8 + length + entry["data_offsets"][0] for name, entry in header.items() if name != "__metadata__"}
