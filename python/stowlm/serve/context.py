"""What every route of the server shares: the LLM and its engine, the model's name, the metrics,
and the checks every request goes through (API key, JSON body, model name), with errors in
OpenAI's shape."""
from __future__ import annotations

import json
import os
import time
from typing import Mapping, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse

from .metrics import Metrics
from .protocol import APIError

__all__ = ["ServerContext"]


class ServerContext:
    def __init__(self, llm, engine, model_id: Optional[str], api_key: Optional[str]):
        self.llm, self.engine, self.api_key = llm, engine, api_key
        self.model_id = model_id or os.path.splitext(os.path.basename(os.fspath(llm.path)))[0]
        self.created = int(time.time())
        self.metrics = Metrics()
        self.tok = llm.tokenizer

    def error(self, e: APIError, path: str) -> JSONResponse:
        self.metrics.count(path, e.status)
        headers = {"Retry-After": "1"} if e.status == 503 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    def check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        if not auth.startswith("Bearer "):
            raise APIError(401, "Missing API key: send it as 'Authorization: Bearer KEY'.", code="invalid_api_key")
        if auth[len("Bearer "):].strip() != self.api_key:
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")

    async def read_json(self, request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"The request body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "The request body must be a JSON object.", code="invalid_json")
        return body

    async def generation_body(self, request: Request) -> dict:
        """The checked body of a request that generates: its key, a server that generates, JSON,
        the model's name."""
        self.check_key(request)
        if self.llm.embedding:
            raise APIError(400, "This server computes embeddings only (--embeddings); start one without it to "
                                "generate.", code="generation_disabled")
        body = await self.read_json(request)
        self.check_model(body)
        return body

    def check_model(self, body: Mapping) -> None:
        m = body.get("model")
        if m is None:
            return
        if not isinstance(m, str):
            raise APIError(400, "'model': must be a string", param="model", code="invalid_value")
        if m not in (self.model_id, os.path.basename(os.fspath(self.llm.path))):
            raise APIError(404, f"The model '{m}' does not exist; this server serves '{self.model_id}'.",
                           param="model", code="model_not_found")
