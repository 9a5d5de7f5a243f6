"""vLLM's ``GET /tokenizer_info`` (``--enable-tokenizer-info-endpoint``): the model's
tokenizer configuration and chat template, as its workers published it at
``bf:{model}:tokenizer`` when they started (``worker/tokenizer_info.py``): the gateway
holds no tokenizer. vLLM serves one model; a fleet's is named by ``?model=`` (a LoRA
adapter's is its base model's), which may be left out where the fleet serves one."""

from __future__ import annotations

import json

from ...schemas.errors import BatchfleetError
from ...schemas.keys import ModelKeys
from .errors import ApiError, invalid, of_exception
from .handler import Handler


class TokenizerInfo(Handler):
    """``GET /tokenizer_info[?model=NAME]``: vLLM's body (``tokenizer_class``, the
    tokenizer's ``tokenizer_config.json`` values, ``chat_template``)."""

    async def get(self) -> None:
        try:
            model = await self._model(self.get_argument("model", None))
            await self.gateway.check_model(model)
            raw = await self.gateway.producer.client.get(ModelKeys(model).tokenizer)
        except ApiError as exc:
            return self.fail(exc)
        except BatchfleetError as exc:
            return self.fail(of_exception(exc))
        if raw is None:
            return self.fail(ApiError(404, f"the workers of {model!r} published no tokenizer "
                                      "info (the model has no tokenizer, or they are older "
                                      "than the gateway)", code="not_found"))  # fmt: skip
        try:
            config = json.loads(raw)
        except ValueError:
            config = None
        if not isinstance(config, dict):
            return self.fail(ApiError(500, f"the tokenizer info of {model!r} is not a JSON "
                                      "object", code="internal"))  # fmt: skip
        self.send_json(config)

    async def _model(self, name: str | None) -> str:
        """The model asked for (an adapter: its base), or the fleet's one model."""
        names = await self.gateway.models()
        if name:
            return name if name in names else (await self.gateway.adapters()).get(name, name)
        if len(names) != 1:
            served = f"serves {len(names)} models" if names else "serves no model"
            raise invalid(f"the fleet {served}: name one (?model=NAME)", "model")
        return names[0]
