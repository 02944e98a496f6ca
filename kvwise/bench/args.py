"""Every benchmark's command-line flags (``kvwise bench throughput | prefix | load | chat |
breakeven | cluster``), apart from the benchmarks themselves so that building ``kvwise``'s
parser imports none of them (they import torch or the engine at module level). Imports only
argparse and the cluster's routing names: no torch. The engine flags of the benchmarks that
build an engine are added by the parser (``engine_flags`` in ``kvwise/cli/commands.py``)."""

from __future__ import annotations

import argparse

from kvwise.cluster.routing import ROUTING_MODES

# what `kvwise bench cluster` compares: one replica holding every pool, then N replicas under
# each routing policy
CLUSTER_MODES = ("one big replica", *ROUTING_MODES)


def add_throughput_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--reps", type=int, default=5, help="repetitions per figure (median)")
    p.add_argument("--decode-tokens", type=int, default=128, help="tokens in the decode test")
    p.add_argument("--batch", type=int, default=16, help="concurrent requests")
    p.add_argument("--prefill-lens", default="512,2048", help="prompt lengths for prefill")
    p.add_argument("--no-peer", action="store_true", help="skip transformers")
    p.add_argument(
        "--compare-quantization",
        default="none",
        help="a second kvwise column in this weight format ('' to skip; default: float32)",
    )
    p.add_argument("--llama-cpp", default=None, help="directory of llama-bench / llama-server")
    p.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp")
    p.add_argument("--out", default=None, help="write the results as JSON here")


def add_prefix_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--reps", type=int, default=5, help="repetitions per figure (median)")
    p.add_argument("--prefix-len", type=int, default=2048, help="cached prefix length")
    p.add_argument("--out", default=None, help="write the results as JSON here")


def add_vllm_args(p: argparse.ArgumentParser) -> None:
    """vLLM's CPU build as a peer (``bench/vllm_peer.py``): run where its python is given."""
    p.add_argument(
        "--vllm-python",
        default=None,
        help="the python of vLLM's CPU venv (else $KVWISE_VLLM_PYTHON)",
    )
    p.add_argument(
        "--vllm-model",
        default=None,
        help="vLLM's HF directory (default: the default model, saved as one)",
    )


def add_load_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--clients", type=int, default=64, help="concurrent streaming clients")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of load per server")
    p.add_argument("--max-requests", type=int, default=5000, help="cap on requests per server")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per answer")
    p.add_argument("--llama-cpp", default=None, help="directory of llama-server")
    p.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp")
    p.add_argument("--slot-ctx", type=int, default=1024, help="llama-server context per slot")
    p.add_argument(
        "--slots",
        default=None,
        help="llama-server slot counts to run, comma-separated (default: one per client)",
    )
    p.add_argument("--max-waiting", type=int, default=48, help="kvwise queue bound (429 past it)")
    add_vllm_args(p)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument(
        "--url",
        default=None,
        help="load a server already running at this URL (e.g. http://127.0.0.1:8000) instead "
        "of starting kvwise and llama.cpp",
    )
    p.add_argument("--api-key", default=None, help="with --url: the Bearer key to send")
    p.add_argument("--model", default=None, help="GGUF file (default: the default model)")


def add_chat_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--conversations", type=int, default=4, help="concurrent conversations")
    p.add_argument("--turns", type=int, default=6, help="turns per conversation")
    p.add_argument("--turn-tokens", type=int, default=550, help="new user tokens per turn")
    p.add_argument("--max-tokens", type=int, default=24, help="tokens per answer")
    p.add_argument("--rounds", type=int, default=1, help="alternating rounds per server")
    p.add_argument("--llama-cpp", default=None, help="directory of llama-server")
    p.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp")
    p.add_argument("--model", default=None, help="GGUF file (default: the default model)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    add_vllm_args(p)


def add_agents_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--agents", type=int, default=8, help="agents at once")
    p.add_argument("--rounds", type=int, default=6, help="model turn + tool call rounds each")
    p.add_argument("--result-tokens", type=int, default=400, help="tokens of each tool result")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per model turn at most")
    p.add_argument("--tool-median-s", type=float, default=2.0, help="tool latency median")
    p.add_argument("--tool-p90-s", type=float, default=15.0, help="tool latency p90")
    p.add_argument("--seed", type=int, default=0, help="seeds the tool latencies")
    p.add_argument(
        "--tenants",
        type=int,
        default=1,
        help="tenants the agents alternate between (API keys key-0, key-1, ...; "
        "kvwise only): checks that none reads another's blocks; -N: N keys of "
        "one tenant, the control in which such hits must show",
    )
    p.add_argument(
        "--pool-memory",
        default="300MiB",
        help="kvwise's device pool (default: a quarter of 8 agents' contexts)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="kvwise's KV format (auto: float32; bfloat16 stores what vLLM's and "
        "llama.cpp's KV caches store, per token)",
    )
    p.add_argument(
        "--configs",
        default="tiers,pool,no-cache,llama.cpp,vllm",
        help="tiers, pool, no-cache, llama.cpp, vllm, in this order",
    )
    p.add_argument("--llama-cpp", default=None, help="directory of llama-server")
    p.add_argument(
        "--apis",
        default="chat",
        help="the APIs kvwise's configurations run in: chat, messages, responses (the peers: chat)",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds of every configuration, interleaved (medians reported)",
    )
    add_vllm_args(p)
    p.add_argument("--model", default=None, help="GGUF file (default: the default model)")
    p.add_argument("--out", default=None, help="write the results as JSON here")


def add_breakeven_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--lengths",
        default="16,64,256,1024,2048,4096",
        help="prefix lengths in tokens, comma-separated (the model's context is the limit)",
    )
    p.add_argument("--reps", type=int, default=5, help="repetitions per point (median)")
    p.add_argument("--tiers", default="host,disk,redis", help="tiers to measure")
    p.add_argument(
        "--redis-url",
        default=None,
        help="Redis for the redis tier (default: start redis-server on a loopback port)",
    )
    p.add_argument("--chunk-blocks", default=None, help="entry sizes to compare, e.g. 1,4,8,16")
    p.add_argument(
        "--kv-formats",
        default=None,
        help="KV formats to measure in turn and draw on one figure, e.g. float32,int8,int4",
    )
    p.add_argument("--plot", default="docs/breakeven.png", help="write the PNG plot here")
    p.add_argument("--out", default=None, help="write the results as JSON here")


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, default=2, help="engine replicas (default 2)")
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument("--conversations", type=int, default=8, help="per tenant")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--min-doc-tokens", type=int, default=900)
    p.add_argument("--max-doc-tokens", type=int, default=1700)
    p.add_argument("--system-tokens", type=int, default=300, help="the public system prompt")
    p.add_argument("--max-tokens", type=int, default=12, help="tokens per answer")
    p.add_argument("--concurrency", type=int, default=8, help="conversations at once")
    p.add_argument(
        "--think-s",
        type=float,
        default=2.0,
        help="mean pause between a reply and the next turn (exponential; 0: none)",
    )
    p.add_argument("--rounds", type=int, default=1, help="rounds; the modes alternate in each")
    p.add_argument(
        "--modes", default=",".join(CLUSTER_MODES), help="comma-separated subset of modes"
    )
    p.add_argument("--kv-cache-memory", default="768MiB", help="KV pool per replica")
    p.add_argument("--redis-url", default=None, help="a Redis every replica shares (off)")
    p.add_argument("--model", default=None, help="GGUF file (default: the default model)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--plot", default=None, help="PNG of the TTFT distributions")
    p.add_argument("--seed", type=int, default=0)
