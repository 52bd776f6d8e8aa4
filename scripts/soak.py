"""Soak: many concurrent streams against ``pdserve up`` while replicas are killed, checked exactly.

Usage: python scripts/soak.py [--streams 256] [--duration-s 600] [--kill-every-s 120] [--json PATH]

1. computes the greedy reference of every prompt once, in this process, with the same model
   (the requests ignore EOS, so every one has exactly --max-tokens tokens);
2. starts ``pdserve up`` (2 prefills and 2 decodes on CPU by default) and reads its ready line;
3. runs --streams clients, each sending requests back to back until --duration-s has passed; an
   answer counts as failed when it ends with an error or differs from its reference in one token;
4. every --kill-every-s, SIGKILLs one decode and one prefill (each replica in turn); ``pdserve up``'s
   supervisor restarts them on their addresses, and the gateway moves the streams they held. A round
   waits until the previous victims serve again (``waited_s`` in the summary): killing the last
   serving replica of a role would leave nothing to move the streams to;
5. samples the RSS of every service every --sample-every-s: after --warm-up-s (counted from the
   start of each process: a restarted replica warms up again) it must stay within --rss-tolerance
   of its first sample after warm-up;
6. at the end, waits for the clients, then checks that every prefill holds no parked or lent KV and
   every decode runs, queues and holds nothing.
Prints one JSON summary on stdout (exit 0 when every check holds, 1 otherwise); ``pdserve up``'s
log goes to --log (stderr by default).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import grpc
import psutil
import torch
from prometheus_client.parser import text_string_to_metric_families

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from pdserve.v1 import gateway_pb2, gateway_pb2_grpc, sampling_pb2  # noqa: E402

MB = 1024 * 1024
NUM_CHANNELS = 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-llama", help="model preset or directory")
    parser.add_argument("--cache-dir", default="", help="model cache directory ('' = pdserve's default)")
    parser.add_argument("--prefills", type=int, default=2, help="prefill replicas")
    parser.add_argument("--decodes", type=int, default=2, help="decode replicas")
    parser.add_argument("--streams", type=int, default=256, help="concurrent streams")
    parser.add_argument("--duration-s", type=float, default=600.0, help="how long new requests are sent")
    parser.add_argument(
        "--kill-every-s",
        type=float,
        default=120.0,
        help="SIGKILL a decode and a prefill this often (0: never)",
    )
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens of every request")
    parser.add_argument("--num-prompts", type=int, default=32, help="distinct prompts (references)")
    parser.add_argument("--min-prompt", type=int, default=8, help="shortest prompt, in tokens")
    parser.add_argument("--max-prompt", type=int, default=96, help="longest prompt, in tokens")
    parser.add_argument(
        "--warm-up-s", type=float, default=60.0, help="RSS is judged this long after each start"
    )
    parser.add_argument("--sample-every-s", type=float, default=5.0, help="RSS sampling period")
    parser.add_argument("--rss-tolerance", type=float, default=0.10, help="allowed RSS change after warm-up")
    parser.add_argument("--request-timeout-s", type=float, default=600.0, help="deadline of one request")
    parser.add_argument("--startup-timeout-s", type=float, default=600.0, help="wait for pdserve up")
    parser.add_argument("--seed", type=int, default=20261201, help="seed of the prompts")
    parser.add_argument("--json", default="", help="also write the summary to this file")
    parser.add_argument("--log", default="", help="file for pdserve up's log (default: stderr)")
    args = parser.parse_args(argv)
    if args.kill_every_s > 0 and (args.prefills < 2 or args.decodes < 2):
        parser.error("killing replicas needs --prefills and --decodes >= 2 (someone must serve meanwhile)")
    if not 1 <= args.min_prompt <= args.max_prompt:
        parser.error("need 1 <= --min-prompt <= --max-prompt")
    return args


# -- references ------------------------------------------------------------------------------


def make_prompts(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(args.seed)
    span = args.max_prompt - args.min_prompt + 1
    lengths = [args.min_prompt + (i * 37) % span for i in range(args.num_prompts)]
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def load_reference_model(args: argparse.Namespace) -> Any:
    from transformers import AutoModelForCausalLM

    import pdserve.model.deepseek_moe.modeling  # noqa: F401  (registers the DeepSeekMoE models)
    from pdserve.model.source import resolve_model_dir

    path = resolve_model_dir(args.model, args.cache_dir or None)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def greedy_reference(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of one prompt in this process, past EOS (the soak's requests ignore it)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    tokens: list[int] = []
    with torch.no_grad():
        logits = model(torch.tensor([prompt]), cache=cache, use_cache=True).logits[0, -1]
        while True:
            tokens.append(int(torch.argmax(logits)))
            if len(tokens) == max_tokens:
                return tokens
            step = model(torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
            logits = step.logits[0, -1]


# -- pdserve up ------------------------------------------------------------------------------


@dataclass
class Service:
    name: str  # gateway, prefill-0, decode-1, ...
    role: str
    grpc: str
    metrics: str


def start_up(args: argparse.Namespace, log: TextIO) -> tuple[subprocess.Popen[str], list[Service]]:
    command = [
        sys.executable, "-m", "pdserve", "up", "--model", args.model, "--host", "127.0.0.1",
        "--port", "0", "--http-port", "-1", "--device", "cpu",
        "--prefill-replicas", str(args.prefills), "--decode-replicas", str(args.decodes),
        "--startup-timeout-s", str(args.startup_timeout_s),
    ]  # fmt: skip
    if args.cache_dir:
        command += ["--cache-dir", args.cache_dir]
    up = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO_ROOT)
    assert up.stdout is not None
    line = up.stdout.readline()
    if not line:
        raise SystemExit(f"pdserve up exited with {up.wait()} before it was ready")
    ready = json.loads(line)
    gateway = ready["gateway"]
    services = [Service("gateway", "gateway", gateway["grpc"], gateway["metrics"])]
    for role in ("prefill", "decode"):
        for index, info in enumerate(ready[role]):
            services.append(Service(f"{role}-{index}", role, info["grpc"], info["metrics"]))
    return up, services


def current_pid(up: subprocess.Popen[str], service: Service) -> int | None:
    """The pid of the process listening on ``service``'s gRPC port now (a restarted replica has a
    new one)."""
    port = int(service.grpc.rpartition(":")[2])
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(up.pid).children():
            with contextlib.suppress(psutil.Error):
                for conn in child.net_connections(kind="tcp"):
                    if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
                        return int(child.pid)
    return None


def scrape(address: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


# -- the soak --------------------------------------------------------------------------------


@dataclass
class Tally:
    completed: int = 0
    failed: int = 0
    mismatched: int = 0
    tokens: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    first_failures: list[str] = field(default_factory=list)

    def fail(self, what: str) -> None:
        self.failed += 1
        key = what.split(":", maxsplit=1)[0][:80]
        self.errors[key] = self.errors.get(key, 0) + 1
        if len(self.first_failures) < 10:
            self.first_failures.append(what[:300])


async def client(
    stubs: list[gateway_pb2_grpc.GatewayStub],
    index: int,
    prompts: list[list[int]],
    references: list[list[int]],
    args: argparse.Namespace,
    stop_at: float,
    tally: Tally,
) -> None:
    loop = asyncio.get_running_loop()
    stub = stubs[index % len(stubs)]
    n = index
    while loop.time() < stop_at:
        which = n % len(prompts)
        n += args.streams
        request = gateway_pb2.GenerateRequest(
            request_id=f"soak-{index}-{n}",
            prompt_token_ids=prompts[which],
            sampling=sampling_pb2.SamplingParams(
                max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True
            ),
        )
        tokens: list[int] = []
        try:
            async for chunk in stub.Generate(request, timeout=args.request_timeout_s):
                tokens.extend(chunk.token_ids)
        except grpc.aio.AioRpcError as exc:
            tally.fail(f"{exc.code().name}: {exc.details()} (prompt {which}, after {len(tokens)} tokens)")
            continue
        tally.tokens += len(tokens)
        if tokens != references[which]:
            tally.mismatched += 1
            diverged = next(
                (i for i, (a, b) in enumerate(zip(tokens, references[which], strict=False)) if a != b),
                min(len(tokens), len(references[which])),
            )
            tally.fail(f"MISMATCH: prompt {which} diverged at token {diverged} of {len(tokens)}")
            continue
        tally.completed += 1


@dataclass
class RssTrack:
    """RSS samples of one process (a replica's restart starts a new track)."""

    service: str
    pid: int
    started: float
    samples: list[tuple[float, int]] = field(default_factory=list)

    def judged(self, warm_up_s: float) -> list[int]:
        return [rss for t, rss in self.samples if t - self.started >= warm_up_s]


async def sample_rss(
    up: subprocess.Popen[str], services: list[Service], args: argparse.Namespace, stop: asyncio.Event
) -> list[RssTrack]:
    tracks: dict[tuple[str, int], RssTrack] = {}
    while True:
        now = time.monotonic()
        for service in services:
            pid = current_pid(up, service)
            if pid is None:
                continue
            with contextlib.suppress(psutil.Error):
                process = psutil.Process(pid)
                rss = int(process.memory_info().rss)
                key = (service.name, pid)
                if key not in tracks:
                    started = now - max(0.0, time.time() - process.create_time())
                    tracks[key] = RssTrack(service.name, pid, started)
                tracks[key].samples.append((now, rss))
        if stop.is_set():
            return list(tracks.values())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), args.sample_every_s)


async def all_serving(gateway: Service, args: argparse.Namespace) -> bool:
    """Whether the gateway sees every replica SERVING (a killed one is back)."""
    try:
        m = await asyncio.to_thread(scrape, gateway.metrics)
    except OSError:
        return False
    wanted = {"prefill": args.prefills, "decode": args.decodes}
    return all(m.get(f"pdserve_gateway_backends_serving{{role={r}}}", 0) >= n for r, n in wanted.items())


async def killer(
    up: subprocess.Popen[str], services: list[Service], args: argparse.Namespace, stop_at: float
) -> list[dict[str, Any]]:
    """Every --kill-every-s, SIGKILLs a decode and a prefill; a round waits until the replicas killed
    before serve again (killing the last one of a role would leave nothing to move streams to)."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    kills: list[dict[str, Any]] = []
    if args.kill_every_s <= 0:
        return kills
    by_role = {role: [s for s in services if s.role == role] for role in ("prefill", "decode")}
    due = started
    while True:
        due += args.kill_every_s
        if due >= stop_at:
            return kills
        await asyncio.sleep(max(0.0, due - loop.time()))
        while not await all_serving(services[0], args):
            if loop.time() >= stop_at:
                return kills
            await asyncio.sleep(1.0)
        round_ = len(kills)
        killed: dict[str, Any] = {"at_s": round(loop.time() - started, 1)}
        killed["waited_s"] = round(loop.time() - due, 1)  # for the previous victims to serve again
        for role in ("decode", "prefill"):
            victim = by_role[role][round_ % len(by_role[role])]
            pid = current_pid(up, victim)
            if pid is not None:
                with contextlib.suppress(ProcessLookupError, psutil.Error):
                    psutil.Process(pid).send_signal(signal.SIGKILL)
            killed[role] = victim.name if pid is not None else f"{victim.name} (not running)"
        print(f"soak: killed {killed}", file=sys.stderr, flush=True)
        kills.append(killed)
        due = max(due, loop.time())


def leaks(services: list[Service]) -> dict[str, dict[str, float]]:
    """What each prefill and decode still holds (empty when it holds nothing)."""
    watched = {
        "prefill": ("pdserve_kv_parked_handles", "pdserve_kv_parked_bytes", "pdserve_kv_lent_handles"),
        "decode": ("pdserve_decode_running", "pdserve_decode_waiting", "pdserve_decode_kv_blocks_used"),
    }
    found: dict[str, dict[str, float]] = {}
    for service in services:
        if service.role not in watched:
            continue
        try:
            m = scrape(service.metrics)
        except OSError as error:
            found[service.name] = {f"unreachable: {error}": 1.0}
            continue
        held = {name: m.get(name, 0.0) for name in watched[service.role] if m.get(name, 0.0)}
        if held:
            found[service.name] = held
    return found


def rss_summary(tracks: list[RssTrack], args: argparse.Namespace) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for track in tracks:
        judged = track.judged(args.warm_up_s)
        entry: dict[str, Any] = {
            "pid": track.pid,
            "samples": len(track.samples),
            "judged_samples": len(judged),
        }
        if track.samples:
            entry["last_mb"] = round(track.samples[-1][1] / MB, 1)
        if judged:
            base = judged[0]
            entry.update(
                baseline_mb=round(base / MB, 1),
                min_mb=round(min(judged) / MB, 1),
                max_mb=round(max(judged) / MB, 1),
                max_change=round(max(abs(r - base) for r in judged) / base, 4),
            )
            entry["flat"] = entry["max_change"] <= args.rss_tolerance
        summary[f"{track.service} (pid {track.pid})"] = entry
    return summary


def references(args: argparse.Namespace) -> tuple[list[list[int]], list[list[int]], float]:
    """The prompts, their greedy references and the seconds it took to compute them."""
    torch.set_num_threads(1)
    model = load_reference_model(args)
    prompts = make_prompts(args, int(model.config.vocab_size))
    began = time.monotonic()
    expected = [greedy_reference(model, p, args.max_tokens) for p in prompts]
    seconds = time.monotonic() - began
    print(f"soak: {len(prompts)} references computed in {seconds:.1f} s", file=sys.stderr, flush=True)
    return prompts, expected, seconds


async def soak(
    args: argparse.Namespace,
    up: subprocess.Popen[str],
    services: list[Service],
    prompts: list[list[int]],
    references: list[list[int]],
    reference_s: float,
) -> dict[str, Any]:
    gateway = services[0]
    before = scrape(gateway.metrics)
    channels = [grpc.aio.insecure_channel(gateway.grpc) for _ in range(NUM_CHANNELS)]
    stubs = [gateway_pb2_grpc.GatewayStub(c) for c in channels]
    loop = asyncio.get_running_loop()
    started = loop.time()
    stop_at = started + args.duration_s
    tally = Tally()
    sampling_done = asyncio.Event()
    sampler = asyncio.create_task(sample_rss(up, services, args, sampling_done))
    kills_task = asyncio.create_task(killer(up, services, args, stop_at))
    try:
        await asyncio.gather(
            *(client(stubs, i, prompts, references, args, stop_at, tally) for i in range(args.streams))
        )
        elapsed = loop.time() - started
        kills = await kills_task
        # Releases of parked KV and cancellations run in the background, and a replica killed last
        # may still be starting again (unreachable): give them time.
        deadline = loop.time() + max(30.0, args.startup_timeout_s)
        held = leaks(services)
        while held and loop.time() < deadline:
            await asyncio.sleep(1)
            held = leaks(services)
        sampling_done.set()
        tracks = await sampler
    finally:
        kills_task.cancel()
        sampling_done.set()
        for channel in channels:
            await channel.close()
    after = scrape(gateway.metrics)

    def moved(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    rss = rss_summary(tracks, args)
    flat = all(entry.get("flat", True) for entry in rss.values())
    judged = any("flat" in entry for entry in rss.values())
    ok = tally.failed == 0 and not held and flat and tally.completed > 0
    return {
        "ok": ok,
        "settings": {
            "model": args.model,
            "prefills": args.prefills,
            "decodes": args.decodes,
            "streams": args.streams,
            "duration_s": args.duration_s,
            "kill_every_s": args.kill_every_s,
            "max_tokens": args.max_tokens,
            "prompts": len(prompts),
            "warm_up_s": args.warm_up_s,
            "rss_tolerance": args.rss_tolerance,
        },
        "elapsed_s": round(elapsed, 1),
        "reference_s": round(reference_s, 1),
        "requests": tally.completed + tally.failed,
        "completed": tally.completed,
        "failed": tally.failed,
        "mismatched": tally.mismatched,
        "errors": tally.errors,
        "first_failures": tally.first_failures,
        "tokens": tally.tokens,
        "tokens_per_s": round(tally.tokens / elapsed, 1) if elapsed else 0.0,
        "kills": kills,
        "gateway": {
            "decode_moves": moved("pdserve_gateway_retries_total{stage=decode}"),
            "prefill_retries": moved("pdserve_gateway_retries_total{stage=prefill}"),
            "migrated_tokens": moved("pdserve_gateway_migrated_tokens_total"),
        },
        "rss_flat": flat,
        "rss_judged": judged,
        "rss": rss,
        "leaks": held,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log: TextIO = open(args.log, "a") if args.log else sys.stderr  # noqa: SIM115
    prompts, expected, reference_s = references(args)
    up, services = start_up(args, log)
    print(f"soak: pdserve up is ready; {args.streams} streams for {args.duration_s:g} s", file=sys.stderr)
    try:
        summary = asyncio.run(soak(args, up, services, prompts, expected, reference_s))
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()
        if log is not sys.stderr:
            log.close()
    text = json.dumps(summary, indent=2)
    print(text, flush=True)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
