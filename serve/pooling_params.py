"""Pooling: a request that returns one vector for its prompt instead of tokens.

A pooling request (an embedding) is a prefill-only request: `SamplingParams(max_tokens=0,
pooling=PoolingParams(...))`. The engine computes its prompt (in chunks, beside other
requests' steps), samples nothing, and the driver worker pools the model's final hidden
states (after the final norm, before the LM head) over the prompt:

    last   the hidden state at the last prompt token (decoder embedding models' usual)
    mean   the mean over every prompt token
    cls    the hidden state at the first prompt token

then keeps the first `dimensions` entries (Matryoshka truncation) and, with `normalize`,
scales the vector to unit L2 norm. vLLM's `PoolingParams` and pooler config, in a smaller
vocabulary.

`PoolingParams` is what a request asks for (None: the model's default); `ModelPooling` is
the model's defaults and limits, found once at start (serve/models/pooling_config.py) and
applied by the engine core to each request (`resolve`), so the workers read complete
params. Plain data, no torch: the scheduler and the API import it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

POOLING_TYPES = ("last", "mean", "cls")


@dataclass(frozen=True)
class PoolingParams:
    pooling_type: str | None = None  # one of POOLING_TYPES; None: the model's default
    normalize: bool | None = None  # L2-normalise the vector; None: the model's default
    dimensions: int | None = None  # keep the first this many entries (Matryoshka models)

    def __post_init__(self) -> None:
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                f"got {self.pooling_type!r}."
            )
        if self.dimensions is not None and (
            isinstance(self.dimensions, bool)
            or not isinstance(self.dimensions, int)
            or self.dimensions < 1
        ):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}.")

    @property
    def needs_every_position(self) -> bool:
        """Whether pooling reads hidden states before the last prompt token: then no
        prompt token may be skipped as a prefix-cache hit (a hit's hidden state is never
        computed). Unresolved params are assumed to."""
        return self.pooling_type != "last"


@dataclass(frozen=True)
class ModelPooling:
    """A model's pooling: its defaults (from the flags, else its sentence-transformers
    config, else last + normalize) and the `dimensions` it may be truncated to."""

    pooling_type: str
    normalize: bool
    hidden_size: int  # the vector's length before truncation
    # vLLM's rule: `dimensions` only for a model whose config says it was trained for
    # truncation (`is_matryoshka`), to the listed sizes if it lists them.
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None

    @property
    def supports_dimensions(self) -> bool:
        return self.is_matryoshka or bool(self.matryoshka_dimensions)

    def check(self, params: PoolingParams) -> None:
        """ValueError, starting with the field's name, for what this model cannot do."""
        dims = params.dimensions
        if dims is None:
            return
        if not self.supports_dimensions:
            raise ValueError(
                "dimensions is not supported by this model: its config does not declare "
                "Matryoshka training (is_matryoshka or matryoshka_dimensions), and truncating "
                "its embeddings would degrade them. Leave dimensions out."
            )
        if self.matryoshka_dimensions and dims not in self.matryoshka_dimensions:
            sizes = ", ".join(map(str, self.matryoshka_dimensions))
            raise ValueError(f"dimensions must be one of this model's sizes ({sizes}); got {dims}.")
        if dims > self.hidden_size:
            raise ValueError(
                f"dimensions is {dims}, more than this model's embedding size ({self.hidden_size})."
            )

    def resolve(self, params: PoolingParams) -> PoolingParams:
        """`params` with the model's defaults filled in."""
        return replace(
            params,
            pooling_type=params.pooling_type or self.pooling_type,
            normalize=self.normalize if params.normalize is None else params.normalize,
        )
