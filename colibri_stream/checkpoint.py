"""The native model folder: the one definition that the exporter writes through and the runtime reads.

A model folder holds:

    config.json          ModelConfig (see config.py)
    dense.safetensors    every tensor that is not a routed expert, names from `dense_tensor_specs`,
                         CRC32 of each tensor in the metadata key "colibri.crc32"
    experts.bin          all routed experts, layer-major then expert-id order (layout below)
    tokenizer.json, tokenizer_config.json, generation_config.json, chat_template.jinja (when the source has them)

experts.bin layout (little endian):

    offset 0   magic        8 bytes  b"CLBRIEXP"
           8   version      u32      EXPERTS_VERSION
          12   json_len     u32      length of the JSON header that follows the fixed part
          16   num_entries  u32      len(moe_layers) * num_experts
          20   header_crc   u32      CRC32 of the JSON header bytes followed by the index bytes
          24   data_offset  u64      first expert block, a multiple of 4096
          32   JSON header  {"dtype", "block_size", "tensors": [{"name", "dtype", "shape", "offset", "nbytes"}],
                             "moe_layers", "num_experts", "hidden_size", "moe_intermediate_size"}, and
                             "params" for a format that has parameters (int4: group_size, zero_point; fp8:
                             scales and block)
               index        num_entries records of INDEX_DTYPE (layer, expert, offset, size, crc32), 8-byte aligned
    data_offset  blocks     one block per (layer, expert), each `block_size` bytes (a multiple of 4096) at a
                            4096-aligned offset: the tensors of the expert's codec (expert_codecs.py): gate
                            [I, H], up [I, H], down [H, I] back to back (so gate and up form one [2I, H] matrix
                            where gate's bytes are a multiple of 256), then the scales (gate_scale, up_scale,
                            down_scale) and zero points of the quantized formats; zero padding to block_size.

The CRC32 of a block covers all `block_size` bytes, padding included.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import ml_dtypes
import numpy as np

from .config import EXPERT_DTYPES, ModelConfig
from .errors import CheckpointError
from .expert_codecs import FP8, expert_bias_tensors, expert_codec

CONFIG_FILE = "config.json"
EXPERTS_MAGIC = b"CLBRIEXP"
EXPERTS_VERSION = 1
BLOCK_ALIGNMENT = 4096
TENSOR_ALIGNMENT = 256  # inside a block: room for 16-byte vector loads on any row
_FIXED_HEADER = struct.Struct("<8sIIIIQ")  # magic, version, json_len, num_entries, header_crc, data_offset
INDEX_DTYPE = np.dtype(
    [("layer", "<u4"), ("expert", "<u4"), ("offset", "<u8"), ("size", "<u8"), ("crc32", "<u4"), ("reserved", "<u4")]
)
DENSE_CRC_KEY = "colibri.crc32"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
)

NUMPY_DTYPES = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
    "int8": np.dtype(np.int8),
    "uint8": np.dtype(np.uint8),
    "float8_e4m3fn": FP8,
}


def _align(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def _raw_bytes(data) -> memoryview:
    """A byte view of a bytes-like object or an array (any dtype, bfloat16 included)."""
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return memoryview(data).cast("B")


def crc32(data) -> int:
    """CRC32 of a bytes-like object or an array."""
    return zlib.crc32(_raw_bytes(data)) & 0xFFFFFFFF


def corrupt_block_error(file_name: str, layer: int, expert: int) -> CheckpointError:
    """The error for an expert block whose bytes fail their CRC32."""
    return CheckpointError(f"{file_name}: expert {expert} of layer {layer} fails its checksum (the file is corrupt)")


def corrupt_tensor_error(file_name: str, name: str) -> CheckpointError:
    """The error for a dense tensor whose bytes fail their CRC32."""
    return CheckpointError(f"{file_name}: tensor {name} fails its checksum (the file is corrupt)")


# ----------------------------------------------------------------------------------------------------------------
# Tensor names and shapes: the contract between exporter, loader and model.
# ----------------------------------------------------------------------------------------------------------------


def dense_tensor_specs(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor dense.safetensors must hold for `config`, in file order."""
    h, d = config.hidden_size, config.head_dim
    q_width, kv_width = config.num_heads * d, config.num_kv_heads * d
    specs: dict[str, tuple[int, ...]] = {"embed_tokens": (config.vocab_size, h)}
    for layer in range(config.num_layers):
        p = f"layers.{layer}."
        specs[p + "input_norm"] = (h,)
        if config.attention == "mla":
            specs.update(_latent_attention_specs(config, p))
        else:
            specs[p + "q_proj"] = (q_width, h)
            specs[p + "k_proj"] = (kv_width, h)
            specs[p + "v_proj"] = (kv_width, h)
            specs[p + "o_proj"] = (h, q_width)
        if config.qkv_bias:
            specs[p + "q_bias"] = (q_width,)
            specs[p + "k_bias"] = (kv_width,)
            specs[p + "v_bias"] = (kv_width,)
        if config.o_bias:
            specs[p + "o_bias"] = (h,)
        if config.attention_sinks:
            specs[p + "sinks"] = (config.num_heads,)
        if config.qk_norm == "per_head":
            specs[p + "q_norm"] = (d,)
            specs[p + "k_norm"] = (d,)
        elif config.qk_norm == "full":
            specs[p + "q_norm"] = (q_width,)
            specs[p + "k_norm"] = (kv_width,)
        specs[p + "post_attention_norm"] = (h,)
        if config.is_moe_layer(layer):
            specs[p + "router"] = (config.num_experts, h)
            if config.router_bias:
                specs[p + "router_bias"] = (config.num_experts,)
            if config.score_correction_bias:
                specs[p + "score_correction_bias"] = (config.num_experts,)
            if config.shared_expert_intermediate_size:
                s = config.shared_expert_intermediate_size
                specs[p + "shared_expert.gate_proj"] = (s, h)
                specs[p + "shared_expert.up_proj"] = (s, h)
                specs[p + "shared_expert.down_proj"] = (h, s)
                if config.shared_expert_gate:
                    specs[p + "shared_expert_gate"] = (1, h)
        else:
            i = config.intermediate_size
            specs[p + "mlp.gate_proj"] = (i, h)
            specs[p + "mlp.up_proj"] = (i, h)
            specs[p + "mlp.down_proj"] = (h, i)
    specs["norm"] = (h,)
    if not config.tie_word_embeddings:
        specs["lm_head"] = (config.vocab_size, h)
    return specs


def _latent_attention_specs(config: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """Multi-head Latent Attention's tensors of the layer named by prefix `p`."""
    h, heads, rank = config.hidden_size, config.num_heads, config.kv_lora_rank
    nope = config.head_dim - config.rotary_dim
    specs: dict[str, tuple[int, ...]] = {}
    if config.q_lora_rank:
        specs[p + "q_a_proj"] = (config.q_lora_rank, h)
        specs[p + "q_a_norm"] = (config.q_lora_rank,)
        specs[p + "q_b_proj"] = (heads * config.head_dim, config.q_lora_rank)
    else:
        specs[p + "q_proj"] = (heads * config.head_dim, h)
    specs[p + "kv_a_proj"] = (rank + config.rotary_dim, h)  # the latent, then the rope key shared by all heads
    specs[p + "kv_a_norm"] = (rank,)
    specs[p + "kv_b_proj"] = (heads * (nope + config.v_head_dim), rank)  # per head: key rows, then value rows
    specs[p + "o_proj"] = (h, heads * config.v_head_dim)
    return specs


FLOAT32_DENSE_SUFFIXES = (".score_correction_bias",)  # added to scores near one another: kept exact, as trained


def dense_tensor_dtype(name: str, config: ModelConfig) -> str:
    """The storage dtype of dense tensor `name`: config.dtype, but float32 for the correction biases of routers."""
    return "float32" if name.endswith(FLOAT32_DENSE_SUFFIXES) else config.dtype


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor of an expert lives inside its block."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the block
    nbytes: int


def expert_block_layout(config: ModelConfig) -> tuple[list[TensorSlot], int]:
    """The tensors of one expert block (its codec's, then its float32 biases when the config has them, each
    TENSOR_ALIGNMENT aligned) and the block size (a multiple of 4096)."""
    entries = expert_codec(config).expert_tensors(config.hidden_size, config.moe_intermediate_size)
    if config.expert_bias:
        entries += expert_bias_tensors(config.hidden_size, config.moe_intermediate_size)
    slots, offset = [], 0
    for name, dtype, shape in entries:
        nbytes = int(np.prod(shape)) * NUMPY_DTYPES[dtype].itemsize
        slots.append(TensorSlot(name, dtype, shape, offset, nbytes))
        offset = _align(offset + nbytes, TENSOR_ALIGNMENT)
    return slots, _align(offset, BLOCK_ALIGNMENT)


# ----------------------------------------------------------------------------------------------------------------
# experts.bin
# ----------------------------------------------------------------------------------------------------------------


def _experts_header_json(config: ModelConfig, slots: list[TensorSlot], block_size: int) -> bytes:
    params = expert_codec(config).params()
    header = {
        "dtype": config.expert_dtype,
        "block_size": block_size,
        "tensors": [
            {"name": s.name, "dtype": s.dtype, "shape": list(s.shape), "offset": s.offset, "nbytes": s.nbytes}
            for s in slots
        ],
        "moe_layers": list(config.moe_layers),
        "num_experts": config.num_experts,
        "hidden_size": config.hidden_size,
        "moe_intermediate_size": config.moe_intermediate_size,
        **({"params": params} if params else {}),
    }
    return json.dumps(header, sort_keys=True).encode()


class ExpertFileWriter:
    """Writes experts.bin; experts may arrive in any order, each is written once at its fixed offset."""

    def __init__(self, path: str | os.PathLike, config: ModelConfig):
        self.path = Path(path)
        self.config = config
        self.slots, self.block_size = expert_block_layout(config)
        self._header_json = _experts_header_json(config, self.slots, self.block_size)
        self._layer_rank = {layer: rank for rank, layer in enumerate(config.moe_layers)}
        num_entries = len(config.moe_layers) * config.num_experts
        index_start = _align(_FIXED_HEADER.size + len(self._header_json), 8)
        self.data_offset = _align(index_start + num_entries * INDEX_DTYPE.itemsize, BLOCK_ALIGNMENT)
        self._index_start = index_start
        self.index = np.zeros(num_entries, INDEX_DTYPE)
        for rank, layer in enumerate(config.moe_layers):
            for expert in range(config.num_experts):
                entry = self.index[rank * config.num_experts + expert]
                entry["layer"], entry["expert"] = layer, expert
                entry["offset"] = self.data_offset + (rank * config.num_experts + expert) * self.block_size
                entry["size"] = self.block_size
        self._written = np.zeros(num_entries, bool)
        self._file = open(self.path, "wb")
        self._file.truncate(self.data_offset + num_entries * self.block_size)

    def write_expert(self, layer: int, expert: int, tensors: dict[str, np.ndarray]) -> None:
        """Write one expert; `tensors` maps every slot name to an array of the slot's dtype and shape."""
        if layer not in self._layer_rank or not 0 <= expert < self.config.num_experts:
            raise CheckpointError(f"expert ({layer}, {expert}) is outside the model's MoE layers and experts")
        position = self._layer_rank[layer] * self.config.num_experts + expert
        if self._written[position]:
            raise CheckpointError(f"expert ({layer}, {expert}) written twice")
        arrays = []
        for slot in self.slots:
            array = tensors.get(slot.name)
            if array is None:
                raise CheckpointError(f"expert ({layer}, {expert}) lacks tensor {slot.name}")
            if array.dtype != NUMPY_DTYPES[slot.dtype] or tuple(array.shape) != slot.shape:
                raise CheckpointError(
                    f"expert ({layer}, {expert}) {slot.name}: expected {slot.dtype}{list(slot.shape)}, "
                    f"got {array.dtype}{list(array.shape)}"
                )
            arrays.append(array)
        # Each tensor goes straight from the caller's array to the file (no block-sized copy); the padding is
        # already zero since the file was sized up front, and enters the checksum as zeros.
        entry = self.index[position]
        checksum, end = 0, 0
        for slot, array in zip(self.slots, arrays):
            raw = _raw_bytes(array)
            checksum = zlib.crc32(raw, zlib.crc32(bytes(slot.offset - end), checksum))
            self._file.seek(int(entry["offset"]) + slot.offset)
            self._file.write(raw)
            end = slot.offset + slot.nbytes
        entry["crc32"] = zlib.crc32(bytes(self.block_size - end), checksum) & 0xFFFFFFFF
        self._written[position] = True

    def close(self) -> None:
        """Write the header and index; every expert must have been written."""
        if not self._written.all():
            position = int(np.argmin(self._written))
            entry = self.index[position]
            self._file.close()
            raise CheckpointError(f"expert ({entry['layer']}, {entry['expert']}) was never written")
        index_bytes = self.index.tobytes()
        header_crc = crc32(self._header_json + index_bytes)
        fixed = _FIXED_HEADER.pack(
            EXPERTS_MAGIC, EXPERTS_VERSION, len(self._header_json), len(self.index), header_crc, self.data_offset
        )
        self._file.seek(0)
        self._file.write(fixed + self._header_json)
        self._file.seek(self._index_start)
        self._file.write(index_bytes)
        self._file.close()

    def __enter__(self) -> ExpertFileWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self._file.close()


def _stored_format(header: dict) -> str:
    """experts.bin's format and parameters as its header records them, in words."""
    params = header.get("params", {})
    return header["dtype"] + (" (" + ", ".join(f"{k} {v}" for k, v in sorted(params.items())) + ")" if params else "")


# A block's checksum verdict, kept per index entry by ExpertFile.
_UNCHECKED, _INTACT, _CORRUPT = 0, 1, 2


class ExpertFile:
    """Read-only, memory-mapped experts.bin: one expert block is one contiguous read.

    `tensors` checks a block's CRC32 the first time it hands the block out and keeps the verdict, so every block
    is read through its checksum once (a corrupt one raises CheckpointError on every read); `block` is the raw,
    unchecked view.
    """

    def __init__(self, path: str | os.PathLike, config: ModelConfig):
        self.path = Path(path)
        name = self.path.name
        if not self.path.is_file():
            raise CheckpointError(f"{name} is missing from {self.path.parent}")
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            fixed = f.read(_FIXED_HEADER.size)
            if len(fixed) < _FIXED_HEADER.size:
                raise CheckpointError(f"{name} is truncated: {size} bytes, shorter than its header")
            magic, version, json_len, num_entries, header_crc, data_offset = _FIXED_HEADER.unpack(fixed)
            if magic != EXPERTS_MAGIC:
                raise CheckpointError(f"{name} is not a Colibri expert file (magic {magic!r})")
            if version != EXPERTS_VERSION:
                raise CheckpointError(f"{name} has format version {version}; this Colibri reads {EXPERTS_VERSION}")
            index_start = _align(_FIXED_HEADER.size + json_len, 8)
            if index_start + num_entries * INDEX_DTYPE.itemsize > size:
                raise CheckpointError(f"{name} is truncated: its header and index do not fit in {size} bytes")
            header_json = f.read(json_len)
            f.seek(index_start)
            index_bytes = f.read(num_entries * INDEX_DTYPE.itemsize)
        if crc32(header_json + index_bytes) != header_crc:
            raise CheckpointError(f"{name}: header checksum mismatch (the file is corrupt)")
        header = json.loads(header_json)
        if header.get("dtype") not in EXPERT_DTYPES:
            raise CheckpointError(f"{name} stores experts as {header.get('dtype')!r}, a format this Colibri does not "
                                  f"read ({', '.join(EXPERT_DTYPES)})")
        self.index = np.frombuffer(index_bytes, INDEX_DTYPE)
        self.slots, self.block_size = expert_block_layout(config)
        expected = json.loads(_experts_header_json(config, self.slots, self.block_size))
        if expected != header:
            differing = sorted(k for k in header.keys() | expected.keys() if header.get(k) != expected.get(k))
            raise CheckpointError(f"{name} does not match config.json (differs in {', '.join(differing)}; config.json "
                                  f"says {expert_codec(config).describe()}, the file {_stored_format(header)})")
        if num_entries != len(config.moe_layers) * config.num_experts:
            raise CheckpointError(f"{name} has {num_entries} experts, config.json implies "
                                  f"{len(config.moe_layers) * config.num_experts}")
        # in Python's integers: a uint64 sum would wrap for an offset near 2**64
        end = max((int(o) + int(n) for o, n in zip(self.index["offset"], self.index["size"])), default=data_offset)
        if end > size:
            raise CheckpointError(f"{name} is truncated: {size} bytes, its index needs {end}")
        if np.any(self.index["offset"] % BLOCK_ALIGNMENT) or np.any(self.index["size"] != self.block_size):
            raise CheckpointError(f"{name}: index entries are misaligned or of the wrong size")
        self.config = config
        self.data_offset = data_offset
        self._position = {(int(e["layer"]), int(e["expert"])): n for n, e in enumerate(self.index)}
        if len(self._position) != num_entries or any(
            (layer, expert) not in self._position
            for layer in config.moe_layers
            for expert in range(config.num_experts)
        ):
            raise CheckpointError(f"{name}: the index does not list every (layer, expert) exactly once")
        self._verdicts = np.zeros(num_entries, np.uint8)  # [L*E] per index entry: _UNCHECKED, _INTACT, _CORRUPT
        self._file = open(self.path, "rb")
        self._mmap = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        self._buffer = np.frombuffer(self._mmap, np.uint8) if size else np.zeros(0, np.uint8)

    def entry(self, layer: int, expert: int) -> np.void:
        """The index record (offset, size, crc32) of one expert."""
        return self.index[self._entry_position(layer, expert)]

    def _entry_position(self, layer: int, expert: int) -> int:
        try:
            return self._position[(layer, expert)]
        except KeyError:
            raise KeyError(f"no expert ({layer}, {expert}) in {self.path.name}") from None

    def block(self, layer: int, expert: int) -> np.ndarray:
        """The raw bytes of one expert block, a view of the memory map, unchecked.  # [block_size] uint8"""
        e = self.entry(layer, expert)
        return self._buffer[int(e["offset"]) : int(e["offset"]) + int(e["size"])]

    def tensors(self, layer: int, expert: int) -> dict[str, np.ndarray]:
        """Views of one expert's tensors (storage dtype) inside the memory map; CheckpointError naming the layer
        and expert if its block fails its checksum (checked on the first read, the verdict kept)."""
        if not self.block_is_intact(layer, expert):
            raise corrupt_block_error(self.path.name, layer, expert)
        return self.unpack(self.block(layer, expert))

    def unpack(self, block: np.ndarray) -> dict[str, np.ndarray]:
        """Views of the tensors inside one raw expert block (from the map or from a copy of it)."""
        return {
            s.name: block[s.offset : s.offset + s.nbytes].view(NUMPY_DTYPES[s.dtype]).reshape(s.shape)
            for s in self.slots
        }

    def block_is_intact(self, layer: int, expert: int) -> bool:
        """Whether the block matches its CRC32: computed on the first call, then kept. (Threads that ask at once
        both compute it; they find the same verdict.)"""
        position = self._entry_position(layer, expert)
        verdict = self._verdicts[position]
        if verdict == _UNCHECKED:
            intact = crc32(self.block(layer, expert)) == int(self.index[position]["crc32"])
            verdict = self._verdicts[position] = _INTACT if intact else _CORRUPT
        return verdict == _INTACT

    def corrupt_experts(self) -> Iterator[tuple[int, int]]:
        """Yields every (layer, expert) whose block fails its checksum."""
        for e in self.index:
            layer, expert = int(e["layer"]), int(e["expert"])
            if not self.block_is_intact(layer, expert):
                yield layer, expert

    def close(self) -> None:
        self._buffer = np.zeros(0, np.uint8)
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:  # views are still alive; the map closes when they go
                pass
        self._file.close()


# ----------------------------------------------------------------------------------------------------------------
# dense.safetensors
# ----------------------------------------------------------------------------------------------------------------

_SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "int8": "I8"}


class DenseFileWriter:
    """Streams dense.safetensors: the header is written from the planned shapes, then tensors one at a time.

    Tensors must be written in the planned order, so at most one tensor is held in memory at a time.
    """

    def __init__(self, path: str | os.PathLike, plan: dict[str, tuple[tuple[int, ...], str]]):
        self.path = Path(path)
        self._plan = list(plan.items())  # [(name, (shape, dtype))]
        self._next = 0
        self._crc: dict[str, str] = {}
        header: dict[str, object] = {}
        offset = 0
        for name, (shape, dtype) in self._plan:
            nbytes = int(np.prod(shape)) * NUMPY_DTYPES[dtype].itemsize
            header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        self._header = header
        self._data_size = offset
        self._file = open(self.path, "wb")
        # The checksums go into the header, which precedes the data: reserve its room, rewrite it at close.
        self._header_room = len(self._header_bytes(placeholder=True))
        self._file.seek(8 + self._header_room)

    def _header_bytes(self, placeholder: bool = False) -> bytes:
        crc = {name: "00000000" for name, _ in self._plan} if placeholder else self._crc
        header = dict(self._header, __metadata__={DENSE_CRC_KEY: json.dumps(crc, sort_keys=True)})
        return json.dumps(header, sort_keys=True).encode()

    def write(self, name: str, array: np.ndarray) -> None:
        if self._next >= len(self._plan) or self._plan[self._next][0] != name:
            expected = self._plan[self._next][0] if self._next < len(self._plan) else "nothing"
            raise CheckpointError(f"dense tensor {name} written out of order (expected {expected})")
        shape, dtype = self._plan[self._next][1]
        if tuple(array.shape) != tuple(shape) or array.dtype != NUMPY_DTYPES[dtype]:
            raise CheckpointError(f"dense tensor {name}: expected {dtype}{list(shape)}, "
                                  f"got {array.dtype}{list(array.shape)}")
        self._crc[name] = f"{crc32(array):08x}"
        self._file.write(_raw_bytes(array))
        self._next += 1

    def close(self) -> None:
        if self._next != len(self._plan):
            self._file.close()
            raise CheckpointError(f"dense tensor {self._plan[self._next][0]} was never written")
        header = self._header_bytes()
        header += b" " * (self._header_room - len(header))  # same length: every CRC is 8 hex digits
        self._file.seek(0)
        self._file.write(struct.pack("<Q", len(header)) + header)
        self._file.close()


class DenseFile:
    """dense.safetensors of a model folder, checked against the config's tensor specs."""

    def __init__(self, path: str | os.PathLike, config: ModelConfig):
        from safetensors import safe_open

        self.path = Path(path)
        name = self.path.name
        if not self.path.is_file():
            raise CheckpointError(f"{name} is missing from {self.path.parent}")
        try:
            self._file = safe_open(str(self.path), framework="numpy")
        except Exception as exc:  # safetensors raises its own error types for a bad header
            raise CheckpointError(f"{name} is not a readable safetensors file ({exc})") from None
        metadata = self._file.metadata() or {}
        try:
            self._crc = json.loads(metadata[DENSE_CRC_KEY])
        except (KeyError, ValueError, RecursionError):
            raise CheckpointError(f"{name} has no Colibri checksums; re-export the model") from None
        if not isinstance(self._crc, dict):
            raise CheckpointError(f"{name}: its Colibri checksums are not an object of tensor names; re-export the "
                                  "model")
        specs = dense_tensor_specs(config)
        present = set(self._file.keys())
        missing = [n for n in specs if n not in present]
        if missing:
            raise CheckpointError(f"{name} does not match config.json: missing {missing[:5]}"
                                  + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
        extra = sorted(present - set(specs))
        if extra:
            raise CheckpointError(f"{name} does not match config.json: unexpected tensors {extra[:5]}")
        for tensor_name, shape in specs.items():
            dtype = dense_tensor_dtype(tensor_name, config)
            expected_dtype = _SAFETENSORS_DTYPES[dtype]
            tensor = self._file.get_slice(tensor_name)
            actual = tuple(tensor.get_shape())
            if actual != shape:
                raise CheckpointError(
                    f"{name} does not match config.json: {tensor_name} has shape {list(actual)}, "
                    f"expected {list(shape)}"
                )
            if tensor.get_dtype() != expected_dtype:
                wanted = (f"config.json's dtype {config.dtype} is {expected_dtype}" if dtype == config.dtype
                          else f"a router's correction bias is {expected_dtype}")
                raise CheckpointError(f"{name} does not match config.json: {tensor_name} is stored as "
                                      f"{tensor.get_dtype()}, {wanted}")
        self.names = list(specs)

    def get(self, name: str) -> np.ndarray:
        """One tensor in its storage dtype, checked against its CRC32 (CheckpointError naming it if it fails)."""
        array = self._file.get_tensor(name)
        if not self._intact(name, array):
            raise corrupt_tensor_error(self.path.name, name)
        return array

    def corrupt_tensors(self) -> Iterator[str]:
        for name in self.names:
            if not self._intact(name, self._file.get_tensor(name)):
                yield name

    def _intact(self, name: str, array: np.ndarray) -> bool:
        return f"{crc32(array):08x}" == self._crc.get(name)


# ----------------------------------------------------------------------------------------------------------------
# The folder
# ----------------------------------------------------------------------------------------------------------------


def default_model_path() -> Path:
    """The small model shipped inside the package, used when no model folder is given."""
    return Path(__file__).resolve().parent / "default_model"


def read_config(folder: str | os.PathLike) -> ModelConfig:
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"model folder {folder} does not exist")
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{CONFIG_FILE} is missing from {folder}")
    try:
        data = json.loads(path.read_text(), parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise CheckpointError(f"{CONFIG_FILE} is not valid JSON ({exc})") from None
    return ModelConfig.from_dict(data)


def _no_constant(name: str):
    """JSON has no NaN or Infinity (Python's reader takes them): a config value that is one is refused."""
    raise ValueError(f"{name} is not a JSON number")


def write_config(folder: str | os.PathLike, config: ModelConfig) -> None:
    (Path(folder) / CONFIG_FILE).write_text(json.dumps(config.to_dict(), indent=2) + "\n")


class ModelFolder:
    """An opened native model folder: config, dense tensors and the expert file, cross-checked.

    With `verify=True` every checksum is checked at open (reads every byte once); otherwise only the
    headers, sizes and shapes are checked at open, and each dense tensor's and expert block's checksum when it is
    first read (`DenseFile.get`, `ExpertFile.tensors`); `verify()` can be called later.
    """

    def __init__(self, path: str | os.PathLike, verify: bool = False):
        self.path = Path(path)
        self.config = read_config(self.path)
        self.dense = DenseFile(self.path / self.config.dense_file, self.config)
        self.experts = ExpertFile(self.path / self.config.experts_file, self.config)
        if verify:
            self.verify()

    def verify(self) -> None:
        """Raise CheckpointError naming the first corrupt tensor or expert block."""
        for name in self.dense.corrupt_tensors():
            raise corrupt_tensor_error(self.config.dense_file, name)
        for layer, expert in self.experts.corrupt_experts():
            raise corrupt_block_error(self.config.experts_file, layer, expert)

    def tokenizer_files(self) -> list[Path]:
        return [self.path / n for n in TOKENIZER_FILES if (self.path / n).is_file()]

