"""The models a server answers to: the base model by its served names (and its path), and
the LoRA adapters served on top of it, as vLLM's `OpenAIServingModels` keeps them. A
request's `model` resolves here to the adapter it runs with (None: the base model).

Adapters come from `--lora-modules` at start-up and, where the operator allows it, from
`POST /v1/load_lora_adapter` / `unload_lora_adapter` at run time. Only `load` and
`unload` change them, on the event loop (or before it serves); the handlers read them,
from the prompt thread too, so a change replaces the dict rather than editing it.
Each load takes a fresh `lora_int_id`, never one used before: the prefix cache keys K/V
by it, so other weights under an old id would be served that adapter's cached blocks.
Unloading only forgets the name: requests already running with it finish.
"""

from __future__ import annotations

from serve.api.errors import APIError
from serve.api.protocol import OpenAIModel
from serve.api.settings import ServerSettings
from serve.engine.protocol import EngineClient
from serve.lora_request import LoRARequest


class LoadLoRAAdapterRequest(OpenAIModel):
    """POST /v1/load_lora_adapter (vLLM's body)."""

    lora_name: str
    lora_path: str
    # Replace an adapter already loaded under this name (vLLM's; here under a fresh id).
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(OpenAIModel):
    """POST /v1/unload_lora_adapter (vLLM's body)."""

    lora_name: str
    lora_int_id: int | None = None  # when given, the id the adapter must be loaded under


class ServedModels:
    def __init__(
        self,
        settings: ServerSettings,
        engine: EngineClient | None = None,
        allow_runtime_updates: bool = False,
    ) -> None:
        """`engine` checks each adapter before it is served (none: adapters cannot be
        loaded). `allow_runtime_updates`: the load and unload routes are served."""
        self.settings = settings
        self.engine = engine
        self.allow_runtime_updates = allow_runtime_updates
        self._base_names = frozenset((*settings.model_names, settings.model_path))
        self._adapters: dict[str, LoRARequest] = {}  # by name, in the order loaded; replaced
        self._loading: set[str] = set()  # names whose adapter is being checked
        self._last_id = 0

    @property
    def adapters(self) -> tuple[LoRARequest, ...]:
        return tuple(self._adapters.values())

    @property
    def names(self) -> tuple[str, ...]:
        """What /v1/models lists: the base model's served names, then the adapters'."""
        return (*self.settings.model_names, *self._adapters)

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names; None for the base model (any of its
        names, its path, or no model given). A 404 `model_not_found` listing what is
        served for any other name."""
        if model is None or model in self._base_names:
            return None
        adapters = self._adapters
        lora = adapters.get(model)
        if lora is None:
            raise APIError(
                404,
                f"The model `{model}` does not exist. This server serves "
                + ", ".join(f"`{name}`" for name in (*self.settings.model_names, *adapters))
                + ".",
                param="model",
                code="model_not_found",
            )
        return lora

    def reply_name(self, model: str | None) -> str:
        """The `model` a reply carries for a request that named `model` (one `resolve`
        took): an adapter's own name, else the base model's first served name whichever
        of its names was used (as vLLM answers)."""
        if model is None or model in self._base_names:
            return self.settings.served_model_name
        return model

    async def load(
        self, name: str, path: str, base_model_name: str | None = None, replace: bool = False
    ) -> LoRARequest:
        """Serve the adapter in folder `path` as `name`, once the engine has checked it
        loads onto the model. ValueError (the user's mistake) for a missing name or path,
        a name the base model or another adapter has (unless `replace`), an unknown
        `base_model_name`, or an adapter the engine would not load (its message)."""
        if not name or not path:
            raise ValueError("Both 'lora_name' and 'lora_path' must be provided.")
        if name in self._base_names:
            raise ValueError(
                f"The LoRA adapter name '{name}' is a name of the served model; give the "
                "adapter a name of its own."
            )
        if name in self._adapters and not replace:
            raise ValueError(
                f"The LoRA adapter '{name}' has already been loaded. To replace it, set "
                "'load_inplace' to true."
            )
        if name in self._loading:
            raise ValueError(f"The LoRA adapter '{name}' is being loaded by another request.")
        served = self.settings.model_names
        if base_model_name is not None and base_model_name not in served:
            raise ValueError(
                f"base_model_name '{base_model_name}' is not a model this server serves ("
                + ", ".join(f"'{n}'" for n in served)
                + ")."
            )
        if self.engine is None:
            raise ValueError("This server cannot load LoRA adapters.")
        self._last_id += 1  # taken even if the check fails: an id is never used twice
        lora = LoRARequest(name, self._last_id, path, base_model_name)
        self._loading.add(name)
        try:
            await self.engine.check_lora(lora)
        finally:
            self._loading.discard(name)
        self._adapters = {**self._adapters, name: lora}  # a replaced one keeps its place
        return lora

    def unload(self, name: str, lora_int_id: int | None = None) -> LoRARequest:
        """Stop serving adapter `name` to new requests. LookupError (a 404) for a name not
        loaded, or loaded under another id than `lora_int_id`."""
        lora = self._adapters.get(name)
        if lora is None:
            raise LookupError(f"The LoRA adapter '{name}' cannot be found.")
        if lora_int_id is not None and lora_int_id != lora.lora_int_id:
            raise LookupError(
                f"The LoRA adapter '{name}' is loaded with lora_int_id {lora.lora_int_id}, "
                f"not {lora_int_id}."
            )
        self._adapters = {key: value for key, value in self._adapters.items() if key != name}
        return lora
