"""The files benchmarks/quantized.py times, made here: each shape's random model folders (bf16, and one per expert
format: write_synthetic_folder of long_context.py's `benchmark_config`), the bf16 GGUF of the bf16 folder and
llama-quantize's GGUFs of it, or, for mxfp4 with `--llama-dense bf16`, the GGUF written from Colibri's mxfp4 folder
itself (`written_directly`). Their paths under the folder root (`ShapeFiles`), the disk checks before each is written
(predicted bytes against the free space), the deletions that make room for the next, and `--prepare-only`'s files
written ahead of a run (`prepare_shape`). quantized.py's module docstring tells which files a run makes and when.
"""

from __future__ import annotations

import gc
import os
import shutil
import time
import traceback
from pathlib import Path

from decode import log
from long_context import benchmark_config, folder_bytes, gguf_bytes, needs_yarn_truncate

LLAMA_8BIT = "Q8_0"  # llama.cpp's nearest format to fp8 and int8 experts
# llama-quantize's ftype for mxfp4 experts: the experts (3-D tensors) MXFP4, 17 bytes a block of 32 (an e8m0
# exponent and 32 e2m1 codes), as Colibri's mxfp4; every other tensor Q8_0 unless --tensor-type keeps it
LLAMA_MXFP4 = "MXFP4_MOE"
# bits a quantized weight takes, for the disk check
LLAMA_BITS = {"Q4_0": 4.5, "Q4_K_M": 4.9, "Q8_0": 8.5, LLAMA_MXFP4: 4.25}


def attempt(what: str, fn, *args, **kwargs):
    """(fn(*args, **kwargs), None), or (None, the error as text) when it raises: logged with its traceback."""
    try:
        return fn(*args, **kwargs), None
    except Exception as error:  # one failed step is recorded; the run goes on
        traceback.print_exc()
        log(f"{what} failed: {error!r}")
        return None, f"{type(error).__name__}: {error}"[:1500]


def nbytes(path: Path) -> int:
    """Bytes of a file, or of every file under a folder (0 if absent)."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def log_disk(root: Path, what: str) -> None:
    usage = shutil.disk_usage(root)
    log(f"disk: {usage.used / 1e9:.1f} GB used, {usage.free / 1e9:.1f} GB free ({what})")


def remove(path: Path, root: Path) -> None:
    """Delete a file or folder, logging what it freed (models that went out of use collected first: a deleted
    file's space comes back when nothing holds it open or mapped)."""
    gc.collect()
    size = nbytes(path)
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
    else:
        return
    log_disk(root, f"deleted {path.name}, {size / 1e9:.1f} GB")


def require_free(root: Path, needed: float, what: str) -> None:
    free = shutil.disk_usage(root).free
    if needed > free:
        raise OSError(f"{what} needs about {needed / 1e9:.1f} GB, {free / 1e9:.1f} GB free on {root}")


def write_options(name: str, args) -> dict:
    """write_synthetic_folder's expert format options for --formats `name`."""
    if name == "int4":
        return dict(expert_dtype="int4", group_size=args.group_size, zero_point=args.zero_point)
    if name == "fp8":
        return dict(expert_dtype="fp8", scales="block")
    return dict(expert_dtype=name)


def llama_format(name: str, args) -> str:
    """llama.cpp's format of the GGUF that --formats `name` is compared with."""
    if name == "int4":
        return args.llama_int4
    return LLAMA_MXFP4 if name == "mxfp4" else LLAMA_8BIT


def written_directly(name: str, args) -> bool:
    """Whether the GGUF of --formats `name` is written from Colibri's own folder of it (gguf_writer: mxfp4 experts
    as GGML MXFP4, every other matrix bf16), not quantized from the bf16 GGUF: mxfp4 with --llama-dense bf16, the
    same weights bit for bit."""
    return name == "mxfp4" and args.llama_dense == "bf16"


class ShapeFiles:
    """The paths of one shape's files under the folder root (SHAPE-LAYERS-..., with -yarn-truncate for a shape
    that `needs_yarn_truncate`: its model is not the published config's, so no file of the other is reused)."""

    def __init__(self, root: Path, shape: str, layers: int, llama_dense: str):
        self.root, self.llama_dense = root, llama_dense
        self.stem = f"{shape}-{layers}" + ("-yarn-truncate" if needs_yarn_truncate(shape) else "")

    @property
    def bf16_folder(self) -> Path:
        return self.root / f"{self.stem}-bf16"

    @property
    def bf16_gguf(self) -> Path:
        return self.root / f"{self.stem}-bf16.gguf"

    def gguf(self, fmt: str) -> Path:
        return self.root / f"{self.stem}-{fmt}{'-dense-bf16' if self.llama_dense == 'bf16' else ''}.gguf"

    def folder(self, options: dict) -> Path:
        tag = options["expert_dtype"]
        if tag == "int4":
            tag += f"-g{options['group_size']}" + ("-zp" if options["zero_point"] else "")
        return self.root / f"{self.stem}-{tag}"


def ensure_shape_folder(path: Path, shape: str, layers: int, dense_layers: int | None = None, **options) -> Path:
    """`path`, where the benchmark's random model of `shape` with `layers` layers is written first (experts in the
    format of `options`: write_synthetic_folder's) unless a whole folder is there (its config.json, written last).
    The model is long_context.py's `benchmark_config`: the shape's, with YaRN's truncate on where the shape
    `needs_yarn_truncate` (gpt-oss), so the bf16 folder, its GGUF and every quantized folder hold the same draws of
    one model that llama.cpp computes too; with `dense_layers`, that many leading dense layers, the rest MoE."""
    from colibri_stream.checkpoint import CONFIG_FILE
    from colibri_stream.synthetic import write_synthetic_folder

    path = Path(path)
    if not (path / CONFIG_FILE).is_file():
        yarn = ", YaRN's truncate on" if needs_yarn_truncate(shape) else ""
        split = "" if dense_layers is None else f" ({dense_layers} dense)"
        log(f"writing a random {shape} model with {layers} layers{split}{yarn} to {path}"
            + (f" {options}" if options else ""))
        begin = time.perf_counter()
        write_synthetic_folder(path, benchmark_config(shape, layers, dense_layers), **options)
        written = time.perf_counter()
        os.sync()  # the kernel's write-back of tens of GB must not run beside the timed steps
        log(f"written in {written - begin:.0f} s, on the drive {time.perf_counter() - written:.0f} s later")
    return path


def expert_matrix_bytes(config) -> int:
    """Bytes of the routed experts' gate, up and down matrices in bf16, every MoE layer."""
    return len(config.moe_layers) * config.num_experts * 3 * config.hidden_size * config.moe_intermediate_size * 2


def quantized_gguf_bytes(bf16_bytes: int, config, fmt: str, llama_dense: str) -> float:
    """About the bytes of llama-quantize's `fmt` GGUF of a bf16 GGUF of `bf16_bytes`: the routed experts at
    LLAMA_BITS[fmt], the rest bf16 (`llama_dense` bf16) or at most Q8_0's bits (quantized: Q8_0 under MXFP4_MOE, the
    format or a k-quant otherwise)."""
    experts = expert_matrix_bytes(config)
    rest_bits = 16 if llama_dense == "bf16" else max(LLAMA_BITS[fmt], LLAMA_BITS[LLAMA_8BIT])
    return experts * LLAMA_BITS[fmt] / 16 + max(bf16_bytes - experts, 0) * rest_bits / 16


def bf16_pair_refusal(files: ShapeFiles, config) -> str | None:
    """Why the bf16 folder and its bf16 GGUF of a model of `config` (both on disk at once: the run's peak) do not fit
    the free space under the folder root (None: they do), from long_context.py's predictions of their bytes (what
    of the folder is written already counted as written)."""
    folder, gguf, free = folder_bytes(config), gguf_bytes(config), shutil.disk_usage(files.root).free
    need = max(folder - nbytes(files.bf16_folder), 0) + gguf
    log(f"predicted: bf16 folder {folder / 1e9:.1f} GB + bf16 GGUF {gguf / 1e9:.1f} GB; {need / 1e9:.1f} GB to "
        f"write, {free / 1e9:.1f} GB free")
    if need <= free:
        return None
    return (f"the bf16 folder and GGUF need about {need / 1e9:.1f} GB more at once, {free / 1e9:.1f} GB free on "
            f"{files.root}: fewer layers")


def write_bf16_gguf(args, files: ShapeFiles, shape: str, layers: int, prep: dict) -> None:
    """The bf16 GGUF of the shape, from its bf16 folder (written first if missing)."""
    from gguf_writer import write_gguf

    folder = ensure_shape_folder(files.bf16_folder, shape, layers)
    require_free(files.root, nbytes(folder), "the bf16 GGUF")
    begin = time.perf_counter()
    write_gguf(folder, files.bf16_gguf, args.gguf_py)
    prep["bf16_gguf_s"] = time.perf_counter() - begin
    log_disk(files.root, f"bf16 GGUF {nbytes(files.bf16_gguf) / 1e9:.1f} GB in {prep['bf16_gguf_s']:.0f} s")


def write_direct_gguf(args, files: ShapeFiles, folder: Path, gguf: Path, prep: dict) -> None:
    """The GGUF of Colibri's quantized `folder` (written_directly), its seconds in prep["direct_gguf_s"]."""
    from gguf_writer import write_gguf

    require_free(files.root, nbytes(folder) + 1e9, f"the GGUF of {folder.name}")
    begin = time.perf_counter()
    write_gguf(folder, gguf, args.gguf_py)
    prep["direct_gguf_s"] = time.perf_counter() - begin
    log_disk(files.root, f"{gguf.name} {nbytes(gguf) / 1e9:.1f} GB in {prep['direct_gguf_s']:.0f} s")


def quantize_one(args, files: ShapeFiles, config, fmt: str) -> dict:
    """llama-quantize of the bf16 GGUF (of a model of `config`) to `fmt` (every core), every tensor but the experts
    in bf16 unless --llama-dense quantized."""
    from llama_cpp import DENSE_BF16, quantize_gguf

    estimate = quantized_gguf_bytes(nbytes(files.bf16_gguf), config, fmt, args.llama_dense)
    require_free(files.root, estimate + 2e9, f"llama-quantize {fmt}")
    options = DENSE_BF16 if args.llama_dense == "bf16" else ()
    done = quantize_gguf(Path(args.llama_bin) / "llama-quantize", files.bf16_gguf, files.gguf(fmt), fmt,
                         os.cpu_count() or 1, options, timeout=args.llama_timeout)
    log_disk(files.root, f"{fmt} GGUF {done['bytes'] / 1e9:.1f} GB in {done['wall_s']:.0f} s")
    return done


def llama_ggufs(args, files: ShapeFiles, shape: str, layers: int, formats: list[str], prep: dict) -> dict:
    """llama format -> its quantized GGUF's path, or the error (text) that kept it from being made. Missing ones
    are quantized from the bf16 GGUF (written first if missing); the bf16 folder is deleted once the bf16 GGUF
    exists, the bf16 GGUF once the quantized ones do."""
    result: dict = {fmt: files.gguf(fmt) for fmt in formats}
    missing = [fmt for fmt, path in result.items() if not path.is_file()]
    if missing and not files.bf16_gguf.is_file():
        _, error = attempt("bf16 GGUF", write_bf16_gguf, args, files, shape, layers, prep)
        if error is not None:
            return result | {fmt: f"bf16 GGUF: {error}" for fmt in missing}
    remove(files.bf16_folder, files.root)  # the GGUF holds its weights now; Colibri's folders are drawn anew
    for fmt in missing:
        done, error = attempt(f"llama-quantize {fmt}", quantize_one, args, files, benchmark_config(shape, layers),
                              fmt)
        prep.setdefault("llama_quantize", {})[fmt] = done or {"error": error}
        if error is not None:
            result[fmt] = f"llama-quantize: {error}"
    remove(files.bf16_gguf, files.root)
    return result


def prepare_shape(args, spec: str) -> None:
    """--prepare-only: the files a later run with the same options times, written without llama.cpp's binaries (so
    while they build): the bf16 GGUF with its bf16 folder (kept for the bf16 offload) where both fit the disk, then
    Colibri's folder of each format where it fits after them (a quantized folder's bytes taken as those of the
    llama.cpp GGUF of its nearest format). Nothing is timed or deleted; what did not fit is written by the later run
    after it has freed the space."""
    shape, layers = spec.split(":")[0], int(spec.split(":")[1])
    root = Path(args.folder_root)
    root.mkdir(parents=True, exist_ok=True)
    files, config = ShapeFiles(root, shape, layers, args.llama_dense), benchmark_config(shape, layers)
    log_disk(root, f"{shape} ({layers} layers), preparing")
    from_bf16 = [name for name in args.formats if not written_directly(name, args)]
    if args.gguf_py and from_bf16 and not files.bf16_gguf.is_file():
        too_big = bf16_pair_refusal(files, config)
        if too_big is None:
            attempt("bf16 GGUF", write_bf16_gguf, args, files, shape, layers, {})
        else:
            log(f"no bf16 GGUF prepared: {too_big}")
    for name in args.formats:
        options = write_options(name, args)
        estimate = quantized_gguf_bytes(folder_bytes(config), config, llama_format(name, args), "bf16")
        _, error = attempt(f"{name} folder", ensure_folder_if_free, files.folder(options), estimate, shape, layers,
                           options)
        log_disk(root, f"{name} folder")
        gguf = files.gguf(llama_format(name, args))
        if error is None and args.gguf_py and written_directly(name, args) and not gguf.is_file():
            attempt(f"{name} GGUF", write_direct_gguf, args, files, files.folder(options), gguf, {})


def ensure_folder_if_free(path: Path, estimate: float, shape: str, layers: int, options: dict) -> None:
    """ensure_shape_folder, refused (OSError) where `estimate` bytes and 2 GB to spare are not free."""
    from colibri_stream.checkpoint import CONFIG_FILE

    if not (path / CONFIG_FILE).is_file():
        require_free(path.parent, estimate + 2e9, path.name)
    ensure_shape_folder(path, shape, layers, **options)
