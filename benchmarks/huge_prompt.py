"""A huge prompt against a running `core serve`: how long its answer takes, and whether the server keeps
answering others meanwhile.

    core serve --port 8311 &
    python benchmarks/huge_prompt.py http://127.0.0.1:8311 [--mib 7] [--rounds 2]

Sends a `--mib` MiB prompt (under the 8 MiB --max-request-bytes) as a chat message and as a completions prompt
(both refused: past the context window) and as a completions prompt with truncate_prompt_tokens (accepted,
so tokenized whole), while polling GET /health every 10 ms and running a stream beside it: prints each
answer's time, the longest /health round trip and the longest gap between the stream's tokens. Nothing is
asserted. On the default model, 2-core AMD EPYC, 7 MiB: refusals 7.6-8.8 s while the prompt was tokenized
first, 0.09-0.20 s since core/prompt_bound.py; the accepted one ~7.5 s of tokenizing off the event loop
(/health at most 120-205 ms meanwhile).
"""

from __future__ import annotations

import argparse
import asyncio
import time

import httpx

SENTENCE = "All work and no play makes Jack a dull boy. "


async def poll_health(http: httpx.AsyncClient, stop: asyncio.Event, times: list[float]) -> None:
    while not stop.is_set():
        start = time.perf_counter()
        await http.get("/health")
        times.append(time.perf_counter() - start)
        await asyncio.sleep(0.01)


async def stream_gaps(http: httpx.AsyncClient, model: str, stop: asyncio.Event, gaps: list[float]) -> None:
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 64, "stream": True, "ignore_eos": True}
    while not stop.is_set():
        last = None
        async with http.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append(now - last)
                    last = now


async def timed(http: httpx.AsyncClient, route: str, body: dict) -> str:
    stop, health, gaps = asyncio.Event(), [], []
    beside = [asyncio.create_task(poll_health(http, stop, health)),
              asyncio.create_task(stream_gaps(http, body["model"], stop, gaps))]
    await asyncio.sleep(0.5)
    health.clear()
    gaps.clear()
    start = time.perf_counter()
    response = await http.post(route, json=body)
    took = time.perf_counter() - start
    stop.set()
    await asyncio.gather(*beside, return_exceptions=True)
    code = response.json().get("error", {}).get("code", "") if response.status_code != 200 else ""
    return (f"{response.status_code} {code} in {took:.2f} s; longest /health {max(health, default=0) * 1e3:.0f} ms, "
            f"longest gap between stream tokens {max(gaps, default=0) * 1e3:.0f} ms")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("--mib", type=float, default=7.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    text = SENTENCE * int(args.mib * 2**20 / len(SENTENCE))
    async with httpx.AsyncClient(base_url=args.url, timeout=600) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        cases = {"chat, refused": ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}),
                 "completions, refused": ("/v1/completions", {"prompt": text}),
                 "completions, truncate_prompt_tokens 64": ("/v1/completions",
                                                            {"prompt": text, "truncate_prompt_tokens": 64})}
        print(f"prompt: {len(text):,} characters")
        for name, (route, body) in cases.items():
            for _ in range(args.rounds):
                print(f"{name}: {await timed(http, route, {'model': model, 'max_tokens': 1, **body})}", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
