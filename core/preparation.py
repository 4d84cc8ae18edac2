"""The preparation stage: a request's slow work before the backend, on worker threads off the event loop.

`PreparationStage.prepare` fetches and decodes the request's images on the `core-media` threads (a slow
image URL delays only its own request), then renders the template, runs the vision processor's
`preprocess`, tokenizes and checks the limits (`RequestPreparer.prepare`) on one of two `core-prepare`
threads (HF tokenizers release the GIL). `encode_images` runs the vision encoder on the one
`core-vision` thread when the request is about to reach the backend. The threads start on first use.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Callable
from typing import Any

from core.config import GenerationConfig
from core.media import extract_images, is_decoded_image, load_images, with_loaded_images
from core.memory import trim_heap
from core.openmp import release_openmp_pool
from core.request import Inputs, PreparedRequest, RequestPreparer, is_message_list
from core.vision import MultiModalInputs, VisionProcessor

MEDIA_THREADS = 4  # concurrent image fetches and decodes
PREPARE_THREADS = 2  # requests rendered and tokenized at once, off the event loop


class PreparationStage:
    """The worker threads of one engine, and the work it runs on them."""

    def __init__(self, preparer: RequestPreparer, vision: VisionProcessor | None) -> None:
        self.preparer = preparer
        self.vision = vision
        self._pools: dict[str, concurrent.futures.ThreadPoolExecutor] = {}
        self._closed = False

    async def prepare(self, inputs: Inputs, config: GenerationConfig, **render_options: Any) -> PreparedRequest:
        """The request ready to run, or its request error. A failed preparation is usually an input too
        large for the context: its render and tokens (hundreds of MB for a multi-MB message) are freed
        but kept by the allocator, so the heap is trimmed on a preparation thread, without waiting."""
        try:
            inputs = await self.load_media(inputs)
            return await self._run("core-prepare", self.preparer.prepare, inputs, config, **render_options)
        except BaseException:
            if not self._closed:  # a request cut short by the engine's close has no thread left to trim on
                self._pool("core-prepare").submit(trim_heap)
            raise

    async def off_loop(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``function(*args, **kwargs)`` on a preparation thread (tokenizing for /tokenize, say)."""
        return await self._run("core-prepare", function, *args, **kwargs)

    async def load_media(self, inputs: Inputs) -> Inputs:
        """``inputs`` with their images fetched and decoded on the media threads.

        Inputs without images, and engines without a vision processor (which refuse images while
        preparing), pass through as they are; a bad image raises the InvalidRequestError naming its field.
        """
        if self.vision is None or not is_message_list(inputs):
            return inputs
        _, sources = extract_images(inputs)
        if all(is_decoded_image(s.source) for s in sources):
            return inputs
        images = await self._run("core-media", load_images, sources, self.preparer.media_policy)
        return with_loaded_images(inputs, images)

    async def encode_images(self, inputs: MultiModalInputs) -> list[Any]:
        """The images' embeddings from the vision encoder, on the vision thread."""
        return await self._run("core-vision", self._encode, inputs)

    def _encode(self, inputs: MultiModalInputs) -> list[Any]:
        """On the vision thread: encode, then free its OpenMP workers (core.openmp)."""
        assert self.vision is not None
        try:
            return self.vision.encode(inputs)
        finally:
            release_openmp_pool()

    def _pool(self, name: str) -> concurrent.futures.ThreadPoolExecutor:
        if name not in self._pools:
            size = {"core-media": MEDIA_THREADS, "core-prepare": PREPARE_THREADS}.get(name, 1)
            self._pools[name] = concurrent.futures.ThreadPoolExecutor(size, thread_name_prefix=name)
        return self._pools[name]

    async def _run(self, pool: str, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        call = functools.partial(function, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._pool(pool), call)

    def close(self) -> None:
        """Stop the threads; work still queued is cancelled."""
        self._closed = True
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
