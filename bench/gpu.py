"""GPU benchmark in one device call: paged-attention kernels against the memory roofline,
decode step time eager vs CUDA graphs against the weights-bytes roofline, and output
tokens/s against HF `generate` on the same model and prompts.

    python -m bench.gpu [--out bench/results/gpu_<device>.json]
    TRITON_INTERPRET=1 python -m bench.gpu --smoke     # tiny shapes on CPU: checks the script

Sections (all numbers also land in the JSON, with device name and versions):
1. Device-to-device copy bandwidth (read + write bytes / time) of a 2 GiB buffer: the
   practical HBM roofline.
2. Decode attention kernel (Llama-3-8B heads: 32 query, 8 KV, head_dim 128, bf16, block 16)
   at batch 1, 8, 64 and context 512, 2048, 8192: time, effective bandwidth (K and V bytes
   read / time) and its fraction of the copy bandwidth; torch `scaled_dot_product_attention`
   on contiguous K/V of the same shapes for comparison; and the kernel's output checked
   against the plain-torch reference. Prefill kernel on a batch of prompts: TFLOP/s.
3. Decode step time (the worker's `ModelRunner` path: metadata, forward, sampling) of a
   Llama-3-8B-shaped random-weight bf16 model at batch 1, 8, 64, eager vs CUDA graphs,
   against weights bytes / copy bandwidth.
4. Output tokens/s of the same model: Tandem's runner (batched prefill, then graph decode)
   vs HF `generate` (same weights, same prompt ids, sdpa, greedy), and how many greedy
   tokens agree.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
LLAMA3_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
)
SMOKE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=256,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
)


def timed(fn: Callable[[], object], device: torch.device, repeat: int = 20) -> float:
    """Median seconds of `fn` after warm-up (CUDA events on GPU)."""
    for _ in range(3 if repeat > 2 else 1):
        fn()
    samples = []
    for _ in range(repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - began)
    return statistics.median(samples)


def timed_in_graph(fn: Callable[[], object], calls: int = 20, repeat: int = 20) -> float:
    """Median seconds of one `fn` call replayed from a CUDA graph of `calls` calls: the
    kernels' own time, without the host's launch overhead (the serving path replays decode
    steps from graphs too)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    samples = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / calls)
    del graph
    return statistics.median(samples)


def device_info(device: torch.device) -> dict:
    import triton

    info = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            device=props.name,
            capability=f"{props.major}.{props.minor}",
            memory_gib=round(props.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
            sms=props.multi_processor_count,
        )
    else:
        info.update(device="cpu (smoke run)")
    return info


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), device)
    return 2 * nbytes / seconds / 1e9


# -- 2. kernels -----------------------------------------------------------------------------
def kernel_section(device: torch.device, shapes: dict, copy_gbps: float, smoke: bool) -> dict:
    from kernels.paged_decode_attention import paged_decode_attention
    from kernels.paged_prefill_attention import paged_prefill_attention
    from kernels.torch_paged import paged_attention
    from services.worker.kv_cache import KvCache

    q_heads, kv_heads, head_dim, block = (
        shapes["q_heads"],
        shapes["kv_heads"],
        shapes["head_dim"],
        16,
    )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    scale = head_dim**-0.5
    rows = []
    for batch in shapes["batches"]:
        for context in shapes["contexts"]:
            blocks_per_seq = context // block
            cache = KvCache(batch * blocks_per_seq + 1, block, 1, kv_heads, head_dim, dtype, device)
            cache.data.normal_()
            k_cache, v_cache = cache.layer(0)
            perm = torch.randperm(batch * blocks_per_seq, device=device).to(torch.int32) + 1
            tables = perm.view(batch, blocks_per_seq)
            seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
            query = torch.randn(batch, q_heads, head_dim, dtype=dtype, device=device)

            def run_kernel(
                query=query,
                k_cache=k_cache,
                v_cache=v_cache,
                tables=tables,
                seq_lens=seq_lens,
                context=context,
            ):
                return paged_decode_attention(
                    query, k_cache, v_cache, tables, seq_lens, scale, max_seq_len=context
                )

            seconds = timed(run_kernel, device, repeat=1 if smoke else 50)
            in_graph = timed_in_graph(run_kernel) if device.type == "cuda" else seconds
            kv_bytes = 2 * batch * context * kv_heads * head_dim * cache.data.element_size()
            reference = paged_attention(
                query.float(),
                k_cache.float(),
                v_cache.float(),
                tables,
                list(range(batch + 1)),
                [context] * batch,
                scale,
            )
            error = (run_kernel().float() - reference).abs().max().item()
            k = k_cache[tables.long()].reshape(batch, context, kv_heads, head_dim).transpose(1, 2)
            v = v_cache[tables.long()].reshape(batch, context, kv_heads, head_dim).transpose(1, 2)
            k, v, q = k.contiguous(), v.contiguous(), query.unsqueeze(2)
            sdpa = timed(
                lambda q=q, k=k, v=v: torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, scale=scale, enable_gqa=True
                ),
                device,
                repeat=1 if smoke else 50,
            )
            rows.append(
                {
                    "batch": batch,
                    "context": context,
                    "kernel_us": round(seconds * 1e6, 2),
                    "kernel_gbps": round(kv_bytes / seconds / 1e9, 1),
                    "fraction_of_copy": round(kv_bytes / seconds / 1e9 / copy_gbps, 3),
                    "kernel_in_graph_us": round(in_graph * 1e6, 2),
                    "fraction_of_copy_in_graph": round(kv_bytes / in_graph / 1e9 / copy_gbps, 3),
                    "sdpa_contiguous_us": round(sdpa * 1e6, 2),
                    "sdpa_gbps": round(kv_bytes / sdpa / 1e9, 1),
                    "max_abs_error_vs_reference": error,
                }
            )
            print(
                f"decode b={batch:<3} ctx={context:<5} {rows[-1]['kernel_us']:>9} us "
                f"{rows[-1]['kernel_gbps']:>7} GB/s ({rows[-1]['fraction_of_copy']:.0%} of "
                f"copy; {rows[-1]['fraction_of_copy_in_graph']:.0%} in a graph)  "
                f"sdpa {rows[-1]['sdpa_gbps']:>7} GB/s  err {error:.1e}",
                flush=True,
            )
            del cache
    # Prefill: a batch of fresh prompts.
    n, length = shapes["prefill"]
    blocks_per_seq = length // block
    cache = KvCache(n * blocks_per_seq + 1, block, 1, kv_heads, head_dim, dtype, device)
    cache.data.normal_()
    k_cache, v_cache = cache.layer(0)
    tables = (torch.arange(n * blocks_per_seq, device=device, dtype=torch.int32) + 1).view(
        n, blocks_per_seq
    )
    qsl = torch.arange(0, (n + 1) * length, length, dtype=torch.int32, device=device)
    seq_lens = torch.full((n,), length, dtype=torch.int32, device=device)
    query = torch.randn(n * length, q_heads, head_dim, dtype=dtype, device=device)
    seconds = timed(
        lambda: paged_prefill_attention(
            query, k_cache, v_cache, tables, qsl, seq_lens, scale, max_query_len=length
        ),
        device,
        repeat=1 if smoke else 20,
    )
    flops = 4 * n * length * length / 2 * q_heads * head_dim  # causal: half the square
    return {
        "decode": rows,
        "prefill": {
            "prompts": n,
            "tokens_each": length,
            "ms": round(seconds * 1e3, 3),
            "tflops": round(flops / seconds / 1e12, 1),
        },
    }


# -- 3. and 4. the model ---------------------------------------------------------------------
def random_model(shape: dict, device: torch.device, dtype: torch.dtype, backend: str):
    """Our model with random weights, and HF's LlamaForCausalLM sharing the same tensors."""
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HfLlama

    from common.model_config import ModelConfig
    from services.worker.models.attention_backend import select_backend
    from services.worker.models.llama import LlamaForCausalLM

    hf_config = LlamaConfig(
        **shape,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
        eos_token_id=None,
        bos_token_id=None,
    )
    config = ModelConfig.from_dict(hf_config.to_dict(), name="llama3-8b-shaped")
    with torch.device("meta"):
        ours = LlamaForCausalLM(config, dtype=dtype, attention=select_backend(backend, device))
        hf = HfLlama(hf_config).to(dtype)
    state = {}
    generator = torch.Generator(device=device).manual_seed(0)
    for name, param in ours.state_dict().items():
        tensor = torch.empty(param.shape, dtype=dtype, device=device)
        if name.endswith("norm.weight"):
            tensor.fill_(1.0)
        else:
            tensor.normal_(0.0, 0.02, generator=generator)
        state[name] = tensor
    ours.load_state_dict(state, assign=True)
    hf.load_state_dict(state, assign=True, strict=False)
    with torch.device(device):  # its inv_freq buffer was built on the meta device
        hf.model.rotary_emb = type(hf.model.rotary_emb)(config=hf_config)
    hf.to(device).eval()
    ours.to(device).eval()  # moves the rotary cos/sin buffers (built on the CPU)
    weight_bytes = sum(t.numel() * t.element_size() for t in state.values())
    return ours, hf, config, weight_bytes


def runner_for(model, config, device, dtype, batch: int, context: int, graphs: bool):
    from common.sampling import SamplingParams
    from common.step_plan import NewRequestData
    from services.worker.batch import PersistentBatch
    from services.worker.cuda_graphs import DecodeGraphs, graph_buckets
    from services.worker.kv_cache import KvCache
    from services.worker.runner import ModelRunner

    block = 16
    per_seq = -(-(context + 1) // block)
    cache = KvCache(
        batch * per_seq,
        block,
        config.num_hidden_layers,
        config.num_key_value_heads,
        config.head_dim,
        dtype,
        device,
    )
    decode_graphs = None
    if graphs:
        decode_graphs = DecodeGraphs(model, cache, graph_buckets(batch), context + 1)
        decode_graphs.capture_all()
    runner = ModelRunner(model, cache, device, decode_graphs)
    persistent = PersistentBatch(block, cache.num_blocks, config.vocab_size)
    return runner, persistent, per_seq, NewRequestData, SamplingParams


def step_section(
    model, config, device, dtype, weight_bytes, copy_gbps, batches, context, use_graphs: bool
) -> list[dict]:
    from common.step_plan import CachedRequestData

    rows = []
    for batch in batches:
        row = {
            "batch": batch,
            "context": context,
            "weights_roofline_ms": round(weight_bytes / (copy_gbps * 1e9) * 1e3, 3),
        }
        for mode in ("eager", "graphs") if use_graphs else ("eager",):
            runner, persistent, per_seq, new_cls, sampling = runner_for(
                model, config, device, dtype, batch, context, graphs=(mode == "graphs")
            )
            prompts = [
                new_cls(
                    str(i),
                    torch.randint(0, config.vocab_size, (context,)).tolist(),
                    list(range(i * per_seq, (i + 1) * per_seq)),
                    0,
                    context,
                    sampling(),
                )
                for i in range(batch)
            ]
            work = persistent.apply([], prompts, [])
            persistent.complete(work, runner.execute(work).sampled)

            def decode_step(persistent=persistent, runner=runner, batch=batch):
                work = persistent.apply(
                    [], [], [CachedRequestData(str(i), [], 1) for i in range(batch)]
                )
                out = runner.execute(work)
                persistent.complete(work, out.sampled)
                for request in persistent.requests.values():  # stay inside the cache
                    del request.token_ids[-1]
                    request.num_computed_tokens -= 1

            seconds = timed(decode_step, device, repeat=2 if device.type == "cpu" else 30)
            row[f"{mode}_ms"] = round(seconds * 1e3, 3)
            graph = runner.graphs.graph_for(batch) if runner.graphs is not None else None
            if graph is not None:  # the forward alone, as replayed: the rest of the step is
                # host work (batch bookkeeping, input copies), LM head, sampling, read-back
                row["graph_replay_ms"] = round(timed(graph.replay, device, repeat=30) * 1e3, 3)
            del runner, persistent
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if use_graphs:
            row["graphs_speedup"] = round(row["eager_ms"] / row["graphs_ms"], 2)
            row["graphs_over_roofline"] = round(row["graphs_ms"] / row["weights_roofline_ms"], 2)
        rows.append(row)
        print(f"step b={batch:<3} " + ", ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    return rows


@torch.inference_mode()
def throughput_section(
    model,
    hf,
    config,
    device,
    dtype,
    prompts: int,
    prompt_len: int,
    new_tokens: int,
    use_graphs: bool,
) -> dict:
    from common.step_plan import CachedRequestData

    runner, persistent, per_seq, new_cls, sampling = runner_for(
        model, config, device, dtype, prompts, prompt_len + new_tokens, graphs=use_graphs
    )
    generator = torch.Generator().manual_seed(1)
    ids = [
        torch.randint(0, config.vocab_size, (prompt_len,), generator=generator).tolist()
        for _ in range(prompts)
    ]
    if device.type == "cuda":
        torch.cuda.synchronize()
    began = time.perf_counter()
    work = persistent.apply(
        [],
        [
            new_cls(
                str(i),
                ids[i],
                list(range(i * per_seq, (i + 1) * per_seq)),
                0,
                prompt_len,
                sampling(),
            )
            for i in range(prompts)
        ],
        [],
    )
    persistent.complete(work, runner.execute(work).sampled)
    for _ in range(new_tokens - 1):
        work = persistent.apply([], [], [CachedRequestData(str(i), [], 1) for i in range(prompts)])
        persistent.complete(work, runner.execute(work).sampled)
    if device.type == "cuda":
        torch.cuda.synchronize()
    ours_s = time.perf_counter() - began
    ours = [persistent.requests[str(i)].token_ids[prompt_len:] for i in range(prompts)]
    batch_ids = torch.tensor(ids, device=device)
    hf(batch_ids[:, :8])  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
    began = time.perf_counter()
    out = hf.generate(
        batch_ids,
        attention_mask=torch.ones_like(batch_ids),
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=0,
    )
    if device.type == "cuda":
        torch.cuda.synchronize()
    hf_s = time.perf_counter() - began
    theirs = out[:, prompt_len:].tolist()
    agree = [
        next((j for j, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), len(x))
        for x, y in zip(ours, theirs, strict=True)
    ]
    total = prompts * new_tokens
    return {
        "prompts": prompts,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "tandem_tokens_per_s": round(total / ours_s, 1),
        "hf_generate_tokens_per_s": round(total / hf_s, 1),
        "ratio": round(hf_s / ours_s, 2),
        "greedy_tokens_agreeing_before_first_difference_mean": statistics.mean(agree),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU check)")
    parser.add_argument("--out", default="")
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type == "cpu" and not args.smoke:
        sys.exit("no CUDA device: run with --smoke (and TRITON_INTERPRET=1) to check the script")
    smoke = args.smoke
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    report = {"benchmark": "gpu", "info": device_info(device), "smoke": smoke}
    out = (
        Path(args.out)
        if args.out
        else RESULTS
        / "gpu_{}.json".format(
            report["info"]["device"].split(" ")[0]
            if smoke
            else report["info"]["device"].replace(" ", "_")
        )
    )

    def save(report: dict) -> None:  # after every section: a crash later keeps what ran
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")

    copy_gbps = copy_bandwidth(device, 2**21 if smoke else 2**31)
    report["copy_gbps_read_plus_write"] = round(copy_gbps, 1)
    print(f"device-to-device copy: {copy_gbps:.1f} GB/s", flush=True)
    shapes = (
        dict(q_heads=4, kv_heads=2, head_dim=16, batches=(1, 2), contexts=(32,), prefill=(2, 32))
        if smoke
        else dict(
            q_heads=32,
            kv_heads=8,
            head_dim=128,
            batches=(1, 8, 64),
            contexts=(512, 2048, 8192),
            prefill=(4, 2048),
        )
    )
    report["kernels"] = kernel_section(device, shapes, copy_gbps, smoke)
    save(report)
    shape = SMOKE if smoke else LLAMA3_8B
    backend = "triton" if device.type == "cuda" else "torch"
    model, hf, config, weight_bytes = random_model(shape, device, dtype, backend)
    report["model"] = {"shape": shape, "dtype": str(dtype), "weight_gib": weight_bytes / 2**30}
    save(report)
    use_graphs = device.type == "cuda"
    report["decode_step"] = step_section(
        model,
        config,
        device,
        dtype,
        weight_bytes,
        copy_gbps,
        (1, 2) if smoke else (1, 8, 64),
        32 if smoke else 1024,
        use_graphs,
    )
    save(report)
    if not args.skip_hf:
        report["throughput"] = throughput_section(
            model,
            hf,
            config,
            device,
            dtype,
            prompts=2 if smoke else 8,
            prompt_len=8 if smoke else 128,
            new_tokens=8 if smoke else 128,
            use_graphs=use_graphs,
        )
        print(json.dumps(report["throughput"]), flush=True)
    save(report)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
