"""Loads a model onto a device: picks the backend and builds the expert store for it.

The one module that knows the concrete backends (NumPy, CuPy) and the expert stores (experts/build.py) together;
the model below it sees only the Backend and ExpertStore interfaces.
"""

from __future__ import annotations

from .backends.base import Backend
from .checkpoint import ModelFolder
from .config import ExpertStoreConfig, ModelConfig
from .errors import ColibriError, UnsupportedModelError
from .experts.build import open_expert_store
from .experts.expert_parallel import Communicator, ExpertParallelRank
from .model.transformer import MoETransformer

DEVICES = ("auto", "cpu", "cuda")


def select_backend(device: str, cpu_threads: int | None = None, matmul_precision: str = "high") -> Backend:
    """The backend for `device`: cpu (NumPy, its routed experts on `cpu_threads` threads; None: every core), cuda
    (CuPy at `matmul_precision`, EngineConfig's), or auto (CuPy when it finds a GPU, else NumPy)."""
    from .backends.cupy_backend import cuda_available

    if device not in DEVICES:
        raise ColibriError(f"unknown device {device!r}: use auto, cpu or cuda")
    if device == "cuda" or (device == "auto" and cuda_available()):
        if not cuda_available():
            raise ColibriError("no CUDA GPU is usable (CuPy is missing or finds no device); use --device cpu")
        from .backends.cupy_backend import CupyBackend

        return CupyBackend(matmul_precision)
    from .backends.numpy_backend import NumpyBackend
    from .experts.cpu_executor import CpuExpertExecutor

    return NumpyBackend(CpuExpertExecutor(cpu_threads))


def check_expert_format(config: ModelConfig, backend: Backend | type[Backend]) -> None:
    """UnsupportedModelError, one line, when `backend` has no kernels for the model's expert format."""
    if config.expert_dtype not in backend.expert_formats:
        raise UnsupportedModelError(
            f"the {backend.name} backend does not run {config.expert_dtype} experts (it runs "
            f"{', '.join(backend.expert_formats)}); run this model with --device cpu, or export it with another "
            f"--quantize (a pre-quantized checkpoint with --dequantize)")


def check_features(config: ModelConfig, backend: Backend | type[Backend]) -> None:
    """UnsupportedModelError, one line, when `backend` does not run some option of the model."""
    if missing := backend.missing_features(config):
        raise UnsupportedModelError(f"the {backend.name} backend does not run {', '.join(missing)} yet "
                                    f"({config.architecture}); run this model with --device cpu")


def load_model(path: str, device: str = "cpu", verify: bool = False,
               experts: ExpertStoreConfig | None = None, max_positions: int | None = None,
               matmul_precision: str = "high", expert_group: Communicator | None = None) -> MoETransformer:
    """Open a native model folder and load it on `device`; `verify` checks every checksum first; `experts` sets
    the expert tiers (default: every expert resident); `max_positions`: the longest sequence it will run (default:
    the model's max_position_embeddings); `matmul_precision`: EngineConfig's (the GPU's tensor-core products);
    `expert_group`: the communicator of an expert-parallel group this model is a rank of (its store then holds the
    rank's shard of the routed experts only), or None."""
    folder = ModelFolder(path, verify=verify)
    experts = experts or ExpertStoreConfig()
    backend = select_backend(device, experts.cpu_threads, matmul_precision)
    check_expert_format(folder.config, backend)
    check_features(folder.config, backend)
    rank = None if expert_group is None else ExpertParallelRank(expert_group, folder.config.num_experts)
    store = open_expert_store(folder, experts, backend.device, None if rank is None else rank.experts)
    return MoETransformer(folder.config, folder.dense, store, backend, max_positions, rank)
