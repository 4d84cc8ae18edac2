"""Soak `core serve` on loopback: rounds of concurrent mixed requests, client aborts and sleep/wakeup.

    python benchmarks/soak.py [--model PATH] [--rounds 2] [--requests 60] [--concurrency 8] [-- SERVE ARGS]

Starts `core serve` (the default model when no --model; arguments after `--` go to it) and runs
`--rounds` identical rounds (same seed). A round sends `--requests` requests, at most `--concurrency`
at once: chat, completions (a prompt string, token ids, or a list of two) and Anthropic messages,
streamed or not, n up to 3, stop strings, sampled or greedy, and embeddings where the server computes
them; about `--abort-fraction` of them are closed by the client at a random point. Under that load it sleeps the server at level 1, wakes it, then at level
2, and wakes it again. It checks:

- no 5xx but the 503 a request gets while the server sleeps (embeddings a sleep aborts included), no
  connection reset, no 4xx;
- every stream well formed (core.testing.wire: one finish per choice, [DONE] / message_stop), and no
  finished text that still holds one of its stop strings;
- after each round: running and waiting gauges and KV blocks in use back to their idle baseline, the
  same greedy outputs as before the first round, the server alive and its log free of tracebacks;
- the server's resident memory (VmRSS) after the later half of the rounds within 10% of after the earlier
  half (medians; two rounds: the second against the first).

Prints the figures (requests by outcome and route, finish reasons, sleep/wakeup latencies, RSS before
and after each round) and exits 1 listing the failures, if any. `nox -s soak` runs it on the default
model; tests/server/test_soak.py runs a short version on a tiny random-weight model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from core.testing import wire
from core.testing.parse import parse_metrics, parse_sse

PROMPTS = ["Tell me a story about a robot.", "What is the capital of France?", "List three colours.",
           "Write a haiku about the sea.", "Explain recursion briefly.", "Count from one to ten.",
           "Why is the sky blue?", "Say hello in Spanish."]
GREEDY_PROMPT = "Describe a quiet morning in a small village."
STOPS = [".", "\n", "e", " the", "!"]
GENERATING_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/messages")
EMBEDDINGS = "/v1/embeddings"
IDLE_GAUGES = ("core:num_requests_running", "core:num_requests_waiting", "core:kv_cache_used_blocks")
RSS_GROWTH_LIMIT = 0.10
START_TIMEOUT_S = 180.0
REQUEST_TIMEOUT_S = 120.0
SLEEP_RETRY_S = 0.25  # a request that meets a sleeping server retries this often
SLEEP_SLACK_S = 0.5  # a 503 this long after a wakeup answered still counts as "while asleep"


@dataclass
class SoakOptions:
    """One soak run. `env` is added to this process's environment for the server."""

    model: str | None = None
    serve_args: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    rounds: int = 2
    requests: int = 60
    concurrency: int = 8
    abort_fraction: float = 0.3
    max_tokens: int = 24
    seed: int = 0
    quiet: bool = False


@dataclass
class RoundFigures:
    """What one round measured."""

    outcomes: Counter = field(default_factory=Counter)  # (route, outcome) -> requests
    finish_reasons: Counter = field(default_factory=Counter)
    transitions: list[tuple[str, float]] = field(default_factory=list)  # ("sleep 1", seconds), ...
    rss_before_kib: int = 0
    rss_after_kib: int = 0
    seconds: float = 0.0


@dataclass
class SoakReport:
    """Every round's figures and every problem found (empty: the soak passed)."""

    rounds: list[RoundFigures] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


# -- the server ------------------------------------------------------------------------------------


class ServeProcess:
    """`core serve` on a free loopback port, its output in a temporary log file."""

    def __init__(self, options: SoakOptions) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        model = [options.model] if options.model else []
        command = [sys.executable, "-m", "core.cli", "serve", *model, "--host", "127.0.0.1",
                   "--port", str(self.port), *options.serve_args]
        self.log_path = Path(tempfile.mkstemp(prefix="core-soak-", suffix=".log")[1])
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(command, env={**os.environ, **options.env}, stdout=log,
                                            stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def rss_kib(self) -> int:
        """VmRSS of the server process, from /proc (0 where there is no /proc)."""
        try:
            status = Path(f"/proc/{self.process.pid}/status").read_text()
        except OSError:
            return 0
        return next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"core serve exited with {self.process.returncode}:\n{self.log()[-3000:]}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"core serve was not healthy within {START_TIMEOUT_S} s:\n{self.log()[-3000:]}")

    def stop(self) -> int:
        """Ctrl-C, as an operator would; killed if it hangs. The exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        return self.process.returncode


# -- the requests ----------------------------------------------------------------------------------


@dataclass
class Planned:
    """One request of a round: where it goes, its body, how many choices it answers with, whether and
    when the client leaves (after `abort_after` SSE events, or seconds for a whole response)."""

    route: str
    body: dict[str, Any]
    choices: int
    abort_after: float | None = None

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def stops(self) -> list[str]:
        stops = self.body.get("stop") or self.body.get("stop_sequences") or []
        return [stops] if isinstance(stops, str) else list(stops)


def plan_round(rng: random.Random, options: SoakOptions, prompt_ids: list[int],
               routes: Sequence[str] = GENERATING_ROUTES) -> list[Planned]:
    """The round's requests to `routes`, drawn from `rng` (the same seed plans the same round)."""
    return [_plan_one(rng, options, prompt_ids, routes) for _ in range(options.requests)]


def _plan_one(rng: random.Random, options: SoakOptions, prompt_ids: list[int], routes: Sequence[str]) -> Planned:
    route = rng.choice(routes)
    if route == EMBEDDINGS:
        inputs = rng.choice([[rng.choice(PROMPTS)], [prompt_ids], PROMPTS * rng.randint(1, 4)])
        abort_after = rng.uniform(0.0, 0.5) if rng.random() < options.abort_fraction else None
        return Planned(route, {"input": inputs}, len(inputs), abort_after)
    body: dict[str, Any] = {"max_tokens": rng.randint(1, options.max_tokens), "stream": rng.random() < 0.6}
    if rng.random() < 0.5:
        body["temperature"], body["seed"] = rng.choice([0.7, 1.0]), rng.randint(0, 1000)
    else:
        body["temperature"] = 0.0
    stop = rng.sample(STOPS, rng.randint(1, 2)) if rng.random() < 0.4 else None
    prompt = rng.choice(PROMPTS)
    n = rng.choice([1, 1, 2, 3]) if route != "/v1/messages" else 1
    prompts = 1
    if route == "/v1/messages":
        body["messages"] = [{"role": "user", "content": prompt}]
        body.update({"stop_sequences": stop} if stop else {})
    else:
        body.update({"n": n, **({"stop": stop} if stop else {})})
        if route == "/v1/chat/completions":
            body["messages"] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}]
        else:
            body["prompt"], prompts = rng.choice([(prompt, 1), (prompt_ids, 1), ([prompt, rng.choice(PROMPTS)], 2)])
    if body["stream"] and route != "/v1/messages" and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    abort_after = None
    if rng.random() < options.abort_fraction:
        abort_after = float(rng.randint(0, 6)) if body["stream"] else rng.uniform(0.0, 0.5)
    return Planned(route, body, n * prompts, abort_after)


@dataclass
class Outcome:
    """What became of one request: an outcome name, the finish reasons, the problems found."""

    name: str
    finish_reasons: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    received_at: float = 0.0


async def send(http: httpx.AsyncClient, planned: Planned) -> Outcome:
    """Send one planned request and check what comes back (an abort closes the connection early)."""
    try:
        if planned.stream:
            return await _send_stream(http, planned)
        if planned.abort_after is None:
            return _check_whole(planned, await http.post(planned.route, json=planned.body))
        try:
            response = await asyncio.wait_for(http.post(planned.route, json=planned.body), planned.abort_after)
        except asyncio.TimeoutError:
            return Outcome("client abort", received_at=time.monotonic())
        return _check_whole(planned, response)
    except httpx.TransportError as exc:
        return Outcome("connection error", problems=[f"{planned.route}: {exc!r}"], received_at=time.monotonic())


async def _send_stream(http: httpx.AsyncClient, planned: Planned) -> Outcome:
    async with http.stream("POST", planned.route, json=planned.body) as response:
        if response.status_code != 200:
            return _check_status(planned, response.status_code, await response.aread())
        lines: list[str] = []
        events = 0
        async for line in response.aiter_lines():
            lines.append(line)
            events += line == ""
            if planned.abort_after is not None and events > planned.abort_after:
                return _check_stream(planned, "\n".join(lines) + "\n", complete=False)
        return _check_stream(planned, "\n".join(lines) + "\n", complete=True)


def _check_status(planned: Planned, status: int, body: bytes) -> Outcome:
    outcome = Outcome(f"{status}", received_at=time.monotonic())
    outcome.problems += wire.check_error_body(planned.route, status, body)
    if status != 503:  # a 503 is only a failure outside a sleep: the round decides
        outcome.problems.append(f"{planned.route} answered {status}: {body[:300]!r}")
    return outcome


def _check_whole(planned: Planned, response: httpx.Response) -> Outcome:
    if response.status_code != 200:
        return _check_status(planned, response.status_code, response.content)
    body = response.json()
    outcome = Outcome("200", received_at=time.monotonic())
    if planned.route == EMBEDDINGS:
        outcome.problems += _embedding_problems(body, planned.choices)
        return outcome
    if planned.route == "/v1/messages":
        outcome.problems += wire.check_anthropic_body(body)
        outcome.finish_reasons.append(body.get("stop_reason"))
        texts = ["".join(b.get("text", "") for b in body.get("content", ()))]
    else:
        outcome.problems += wire.check_openai_body(body, planned.choices)
        outcome.finish_reasons += [c.get("finish_reason") for c in body.get("choices", ())]
        texts = [(c.get("message") or {}).get("content") or c.get("text") or "" for c in body.get("choices", ())]
    outcome.problems += _stop_string_problems(planned, texts)
    return outcome


def _embedding_problems(body: Any, inputs: int) -> list[str]:
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list) or [item.get("index") for item in data] != list(range(inputs)):
        return [f"{EMBEDDINGS}: not {inputs} embeddings in order: {body!r:.200}"]
    if not all(item.get("embedding") and all(isinstance(v, float) for v in item["embedding"]) for item in data):
        return [f"{EMBEDDINGS}: an embedding is not a list of floats: {body!r:.200}"]
    return []


def _check_stream(planned: Planned, text: str, complete: bool) -> Outcome:
    outcome = Outcome("200" if complete else "client abort", received_at=time.monotonic())
    if planned.route == "/v1/messages":
        outcome.problems += wire.check_anthropic_stream(text, complete=complete)
        texts = [wire.anthropic_stream_text(text)] if complete else []
    else:
        outcome.problems += wire.check_openai_stream(text, planned.choices, complete=complete)
        texts = list(wire.openai_stream_texts(text).values()) if complete else []
    outcome.problems += _stop_string_problems(planned, texts)
    if complete:
        outcome.finish_reasons += _stream_finish_reasons(text)
    return outcome


def _stream_finish_reasons(text: str) -> list[str]:
    reasons = []
    for name, data in parse_sse(text):
        payload = wire.json_or_none(data)
        if name == "message_delta":
            reasons.append(payload["delta"]["stop_reason"])
        for choice in payload.get("choices", ()) if isinstance(payload, dict) else ():
            if choice.get("finish_reason"):
                reasons.append(choice["finish_reason"])
    return reasons


def _stop_string_problems(planned: Planned, texts: Sequence[str]) -> list[str]:
    return [f"{planned.route}: the text {t!r:.80} holds a stop string of {planned.stops}"
            for t in texts for s in planned.stops if s in t]


# -- a round ---------------------------------------------------------------------------------------


async def greedy_outputs(http: httpx.AsyncClient, max_tokens: int) -> list[str]:
    """Greedy answers of each route to one prompt, one request at a time (on an idle server)."""
    common = {"max_tokens": max_tokens, "temperature": 0.0}
    messages = [{"role": "user", "content": GREEDY_PROMPT}]
    chat = await http.post("/v1/chat/completions", json={**common, "messages": messages})
    text = await http.post("/v1/completions", json={**common, "prompt": GREEDY_PROMPT})
    anthropic = await http.post("/v1/messages", json={**common, "messages": messages})
    for response in (chat, text, anthropic):
        response.raise_for_status()
    return [chat.json()["choices"][0]["message"]["content"], text.json()["choices"][0]["text"],
            "".join(block.get("text", "") for block in anthropic.json()["content"])]


async def served_routes(http: httpx.AsyncClient) -> tuple[str, ...]:
    """The generating routes, and the embeddings route where the server computes embeddings."""
    embeds = (await http.post(EMBEDDINGS, json={"input": PROMPTS[0]})).status_code == 200
    return GENERATING_ROUTES + ((EMBEDDINGS,) if embeds else ())


async def scrape(http: httpx.AsyncClient) -> dict[str, float]:
    response = await http.get("/metrics")
    response.raise_for_status()
    return parse_metrics(response.text)


async def wait_idle(http: httpx.AsyncClient, baseline: Mapping[str, float], timeout: float = 30.0) -> list[str]:
    """Poll /metrics until the idle gauges are back at `baseline`; the gauges that are not, if any."""
    deadline = time.monotonic() + timeout
    while True:
        sample = await scrape(http)
        off = [f"{g} is {sample.get(g)} (idle: {baseline.get(g)})" for g in IDLE_GAUGES
               if sample.get(g) != baseline.get(g)]
        if not off or time.monotonic() > deadline:
            return off
        await asyncio.sleep(0.1)


async def sleep_cycles(http: httpx.AsyncClient, progress: list[int], total: int, figures: RoundFigures,
                       windows: list[list[float]]) -> list[str]:
    """Sleep at level 1 once a third of the round has finished, wake; at level 2 at two thirds, wake.
    `windows` gets the [start, end] of each sleep (end infinite until the wakeup answered), when a 503
    is expected."""
    problems = []
    for level, share in ((1, 1 / 3), (2, 2 / 3)):
        while progress[0] < total * share:
            await asyncio.sleep(0.02)
        window = [time.monotonic(), math.inf]
        windows.append(window)
        for action, url in ((f"sleep {level}", f"/sleep?level={level}"), ("wakeup", "/wakeup")):
            began = time.monotonic()
            response = await http.post(url)
            figures.transitions.append((action, time.monotonic() - began))
            expected = action != "wakeup"
            if response.status_code != 200 or response.json().get("is_sleeping") is not expected:
                problems.append(f"POST {url} answered {response.status_code} {response.text[:200]}")
            if expected:
                await asyncio.sleep(0.2)  # requests arrive meanwhile and get the 503
        window[1] = time.monotonic()
    return problems


async def run_round(http: httpx.AsyncClient, plan: Sequence[Planned], concurrency: int,
                    figures: RoundFigures) -> list[str]:
    """Send `plan` (at most `concurrency` at once) under the sleep cycles; the problems found."""
    gate = asyncio.Semaphore(concurrency)
    progress: list[int] = [0]
    windows: list[list[float]] = []
    cycler = asyncio.ensure_future(sleep_cycles(http, progress, len(plan), figures, windows))

    async def one(planned: Planned) -> Outcome:
        async with gate:
            outcome = await send(http, planned)
            give_up = time.monotonic() + REQUEST_TIMEOUT_S
            # As a client would: retry while the 503 says the server sleeps (a wakeup may take seconds).
            while outcome.name == "503" and _asleep(windows, outcome) and time.monotonic() < give_up:
                figures.outcomes[planned.route, "503, retried"] += 1
                await asyncio.sleep(SLEEP_RETRY_S)
                outcome = await send(http, planned)
        progress[0] += 1
        return outcome

    outcomes = await asyncio.gather(*(one(p) for p in plan))
    problems = await cycler
    for planned, outcome in zip(plan, outcomes, strict=True):
        figures.outcomes[planned.route, outcome.name] += 1
        figures.finish_reasons.update(outcome.finish_reasons)
        expected = outcome.name == "503" and _asleep(windows, outcome)
        problems += [p for p in outcome.problems if not (expected and "answered 503" in p)]
    return problems


def _asleep(windows: Sequence[list[float]], outcome: Outcome) -> bool:
    """Whether `outcome` came while the server slept (from a sleep call to just after its wakeup)."""
    return any(start <= outcome.received_at <= end + SLEEP_SLACK_S for start, end in windows)


async def soak_rounds(server: ServeProcess, options: SoakOptions, report: SoakReport) -> None:
    limits = httpx.Limits(max_connections=options.concurrency + 8)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=REQUEST_TIMEOUT_S, limits=limits) as http:
        prompt_ids = (await http.post("/tokenize", json={"prompt": PROMPTS[0]})).json()["tokens"]
        reference = await greedy_outputs(http, options.max_tokens)
        routes = await served_routes(http)
        baseline = await scrape(http)
        for index in range(options.rounds):
            figures = RoundFigures(rss_before_kib=server.rss_kib())
            began = time.monotonic()
            plan = plan_round(random.Random(options.seed), options, prompt_ids, routes)
            report.failures += [f"round {index + 1}: {p}" for p in await run_round(http, plan, options.concurrency,
                                                                                   figures)]
            report.failures += [f"round {index + 1}: {p}" for p in await wait_idle(http, baseline)]
            if (after := await greedy_outputs(http, options.max_tokens)) != reference:
                report.failures.append(f"round {index + 1}: greedy outputs changed: {reference} -> {after}")
            figures.seconds, figures.rss_after_kib = time.monotonic() - began, server.rss_kib()
            report.rounds.append(figures)
            if not options.quiet:
                print_round(index + 1, figures)
        report.metrics = await scrape(http)


def rss_problems(rounds: Sequence[RoundFigures]) -> list[str]:
    """The median resident memory after the later half of the rounds must stay within RSS_GROWTH_LIMIT of
    the earlier half's (two rounds: the second against the first). A leak keeps growing round after round;
    the C heap's size after a round wanders around its plateau (8 rounds of the default model on a 2-core
    Zen 4 EPYC: 548, 573, 552, 554, 551, 579, 589, 569 MiB), and a bar on round 1's reading alone failed
    about a third of such runs."""
    if len(rounds) < 2 or not rounds[0].rss_after_kib:
        return []
    half = len(rounds) // 2
    early = statistics.median(r.rss_after_kib for r in rounds[:half])
    late = statistics.median(r.rss_after_kib for r in rounds[half:])
    if late <= early * (1 + RSS_GROWTH_LIMIT):
        return []
    return [f"RSS after rounds {half + 1}-{len(rounds)} (median {late / 1024:.0f} MiB) more than "
            f"{RSS_GROWTH_LIMIT:.0%} over rounds 1-{half}'s (median {early / 1024:.0f} MiB)"]


def soak(options: SoakOptions) -> SoakReport:
    """Start the server, run the rounds, stop it; the figures and the failures."""
    report = SoakReport()
    server = ServeProcess(options)
    try:
        server.wait_healthy()
        asyncio.run(soak_rounds(server, options, report))
        report.failures += rss_problems(report.rounds)
        if server.process.poll() is not None:
            report.failures.append(f"the server died with status {server.process.returncode}")
    finally:
        status = server.stop()
        log = server.log()
        server.log_path.unlink(missing_ok=True)
    if status != 0:
        report.failures.append(f"core serve exited with {status} after Ctrl-C")
    if "Traceback" in log:
        report.failures.append(f"the server logged a traceback:\n{_traceback_excerpt(log)}")
    return report


# -- the figures -----------------------------------------------------------------------------------


def print_round(number: int, figures: RoundFigures) -> None:
    retried = sum(n for (_, outcome), n in figures.outcomes.items() if outcome == "503, retried")
    total = sum(figures.outcomes.values()) - retried
    print(f"round {number}: {total} requests ({retried} retries after a 503 while asleep) in {figures.seconds:.1f} s; RSS {figures.rss_before_kib / 1024:.0f} "
          f"-> {figures.rss_after_kib / 1024:.0f} MiB")
    by_outcome: Counter = Counter()
    for (route, outcome), count in sorted(figures.outcomes.items()):
        by_outcome[outcome] += count
        print(f"  {route:<22} {outcome:<16} {count}")
    print("  by outcome: " + ", ".join(f"{k} {v}" for k, v in sorted(by_outcome.items())))
    print("  finish reasons: " + ", ".join(f"{k} {v}" for k, v in sorted(figures.finish_reasons.items())))
    print("  sleep/wakeup under load: " + ", ".join(f"{a} {s:.2f} s" for a, s in figures.transitions))


def print_summary(report: SoakReport) -> None:
    finished = {k: v for k, v in report.metrics.items() if k.startswith("core:requests_total")}
    print("server /metrics requests_total: " + json.dumps({k.split('"')[1]: v for k, v in finished.items()}))
    print("RSS after each round (MiB): " + ", ".join(f"{r.rss_after_kib / 1024:.0f}" for r in report.rounds))
    if report.failures:
        print(f"FAILED: {len(report.failures)} problems")
        for failure in report.failures[:50]:
            print("  - " + failure)
    else:
        print("soak passed")


def parse_args(argv: Sequence[str]) -> SoakOptions:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="what `core serve` serves (default: its default model)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=60, help="requests per round")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--abort-fraction", type=float, default=0.3)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    argv = list(argv)
    own, serve_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = parser.parse_args(own)
    return SoakOptions(args.model, serve_args, {}, args.rounds, args.requests, args.concurrency,
                       args.abort_fraction, args.max_tokens, args.seed)


def _traceback_excerpt(log: str, limit: int = 3000) -> str:
    """The first traceback in ``log`` and the lines after it, cut in the middle when long: its last frames
    and the exception line are what a reader needs, and a deep stack would push them out."""
    text = log[log.index("Traceback"):]
    lines = text.splitlines()
    end = next((i for i, line in enumerate(lines) if i and line and not line.startswith((" ", "Traceback"))), None)
    text = "\n".join(lines[: end + 1 + 10] if end is not None else lines)  # the exception and what followed
    return text if len(text) <= limit else f"{text[: limit // 3]}\n  ...\n{text[-2 * limit // 3:]}"


def main(argv: Sequence[str] | None = None) -> int:
    report = soak(parse_args(sys.argv[1:] if argv is None else argv))
    print_summary(report)
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
