"""The MLX backend's CUDA path on any device: every custom kernel stood in by a call that
makes outputs of the shapes and dtypes asked for and records the launch. What the path
builds in Python (which kernels, with what arrays and sources) is then seen on the CPU:
`conformance/test_step_ops.py` counts a step's launches and arrays, `tools/cuda_build.py`
compiles each kernel as MLX would. The stand-ins compute nothing: their outputs are zeros
and depend on no input."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from unittest import mock

if TYPE_CHECKING:  # the suite runs a port's backend without MLX
    import mlx.core as mx


#: Set to "1" to run a pytest session with the MLX backend on its CUDA path, its kernels
#: run on the CPU (conformance/emulated_cuda.py, conformance/conftest.py).
EMULATED_CUDA_ENV = "KVSPEC_EMULATED_CUDA"


@dataclass(frozen=True)
class KernelCall:
    """One kernel as the path made it (`mx.fast.cuda_kernel`'s arguments) and the arrays of
    its first launch: what MLX needs to write the kernel's CUDA source."""

    name: str
    source: str
    header: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    inputs: tuple[mx.array, ...]
    output_dtypes: tuple[mx.Dtype, ...]
    #: The dynamic shared memory a block of the kernel is launched with, in bytes.
    shared_memory: int = 0

    @classmethod
    def made(
        cls,
        name: str,
        input_names: Sequence[str],
        output_names: Sequence[str],
        source: str,
        header: str,
        shared_memory: int,
        inputs: Sequence[mx.array],
        output_dtypes: Sequence[mx.Dtype],
    ) -> KernelCall:
        """The call of a kernel made with `mx.fast.cuda_kernel`'s arguments (the first
        five and shared_memory) and launched with `inputs` and `output_dtypes`."""
        return cls(
            name,
            source,
            header,
            tuple(input_names),
            tuple(output_names),
            tuple(inputs),
            tuple(output_dtypes),
            shared_memory,
        )

    def parameters(self) -> list[tuple[str, str]]:
        """The kernel's parameters as MLX declares them (0.32,
        `mlx/backend/cuda/custom_kernel.cpp`): each input as `const T*` followed by its
        Shape, Strides and ndim where the source names them (arrays of at least one
        dimension), then each output as `T*`; as (type, name) pairs."""
        from kvspec.accelerated.cuda_source import cuda_type

        parameters = []
        for name, array in zip(self.input_names, self.inputs, strict=True):
            parameters.append((f"const {cuda_type(array.dtype)}*", name))
            if array.ndim > 0:
                for suffix, kind in (("shape", "Shape"), ("strides", "Strides"), ("ndim", "int")):
                    if f"{name}_{suffix}" in self.source:
                        parameters.append((f"const __grid_constant__ {kind}", f"{name}_{suffix}"))
        for name, dtype in zip(self.output_names, self.output_dtypes, strict=True):
            parameters.append((f"{cuda_type(dtype)}*", name))
        return parameters


class Launches(Counter):
    """Stand-in launches by kernel name; every array they were given (`inputs`) and made
    (`outputs`); each kernel's first launch (`kernels`, by name); every launch in order, as
    its kernel's name and the call's options (`calls`: grid, block, output shapes and
    dtypes)."""

    def __init__(self) -> None:
        super().__init__()
        self.inputs: list[mx.array] = []
        self.outputs: list[mx.array] = []
        self.kernels: dict[str, KernelCall] = {}
        self.calls: list[tuple[str, str]] = []


@contextmanager
def cuda_path() -> Iterator[Launches]:
    """The CUDA path with stand-in kernels, for the time of the block; yields its Launches.
    Every cache of kernel objects is emptied before and after, so that no kernel made by
    a real launch, or by another block's stand-in, is launched in its place."""

    launches = Launches()

    def stand_in(
        name: str,
        input_names: list[str],
        output_names: list[str],
        source: str,
        header: str = "",
        shared_memory: int = 0,
        **_: object,
    ):
        def launch(*, inputs, output_shapes, output_dtypes, **options: object) -> list:
            # A kernel's constants are in its source (cuda_source.cuda_kernel): MLX
            # formats every template argument of a call at every call.
            assert "template" not in options, name
            launches[name] += 1
            launches.inputs.extend(inputs)
            options.update(output_shapes=output_shapes, output_dtypes=output_dtypes)
            launches.calls.append((name, repr(sorted(options.items()))))
            launches.kernels.setdefault(
                name,
                KernelCall.made(
                    name,
                    input_names,
                    output_names,
                    source,
                    header,
                    shared_memory,
                    inputs,
                    output_dtypes,
                ),
            )
            outputs = zero_outputs(output_shapes, output_dtypes)
            launches.outputs.extend(outputs)
            return outputs

        return launch

    with cuda_patches(stand_in):
        yield launches


@contextmanager
def cuda_patches(make: Callable[..., Any]) -> Iterator[None]:
    """For the time of the block, the backend takes its CUDA path, each custom kernel made
    by `make` in place of `mx.fast.cuda_kernel` (`kernels_made_by`)."""
    from kvspec.accelerated import affine, attention_kernels, device, turboquant
    from kvspec.accelerated.caches import reads
    from kvspec.accelerated.caches import turboquant as turboquant_caches

    with ExitStack() as patches:
        patches.enter_context(kernels_made_by(make))
        for module in (device, reads, turboquant, turboquant_caches):
            patches.enter_context(mock.patch.object(module, "fused_kernels_enabled", lambda: True))
        patches.enter_context(mock.patch.object(affine, "_default_encoder", lambda: "cuda"))
        patches.enter_context(mock.patch.object(attention_kernels, "on_cuda", lambda: True))
        yield


def zero_outputs(output_shapes: list, output_dtypes: list) -> list[mx.array]:
    """A stand-in launch's outputs: zeros of the shapes and dtypes the launch asks for."""
    import mlx.core as mx

    return [
        mx.zeros(shape, dtype) for shape, dtype in zip(output_shapes, output_dtypes, strict=True)
    ]


@contextmanager
def kernels_made_by(make: Callable[..., Any]) -> Iterator[None]:
    """For the time of the block, every custom kernel is made by `make` in place of
    `mx.fast.cuda_kernel`. Every kernel object the backend keeps made is dropped before and
    after, so that none made outside the block is launched in it, nor one made in it after."""
    import mlx.core as mx

    from kvspec.accelerated import affine_kernels, attention_kernels, turboquant_kernels

    made = [
        *attention_kernels.KERNEL_CACHES,
        *affine_kernels.KERNEL_CACHES,
        *turboquant_kernels.KERNEL_CACHES,
    ]
    with ExitStack() as stack:
        for cache in made:
            cache.cache_clear()
        stack.callback(lambda: [cache.cache_clear() for cache in made])
        stack.enter_context(mock.patch.object(mx.fast, "cuda_kernel", make))
        yield
