"""LoRA adapter routes, in vLLM's shapes: load and unload at run time (behind the API key, and only when
the server was started with --enable-runtime-lora). Listing is `/v1/models` (each adapter with
``parent`` = the base model)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from core.server.serving import parse_body, state_of

router = APIRouter()


class LoadLoraAdapterRequest(BaseModel):
    """vLLM's body: the name requests will use and the adapter's folder."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM's, ignored


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request) -> Any:
    """Load a PEFT folder under `lora_name`; a 400 naming the field for a bad name, path or folder."""
    body = await parse_body(request, LoadLoraAdapterRequest)
    await state_of(request).engine.load_adapter(body.lora_name, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> Any:
    """Unload an adapter: a 404 if unknown, a 409 while requests run through it."""
    body = await parse_body(request, UnloadLoraAdapterRequest)
    await state_of(request).engine.unload_adapter(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
