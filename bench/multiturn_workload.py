"""The workload of `bench.multiturn` (issue 45): C conversations of T turns, whose working
set outgrows a deliberately small KV pool. Pure.

Turn k's prompt is a shared system prompt, the whole history (every earlier user message
and the model's answer to it) and a new user message; answers are greedy, `max_tokens`
long (EOS ignored). The defaults are chat-shaped: short user messages and answers three
times longer (ShareGPT's user : assistant ratio, scaled down to a 2-core box), eight
turns, so by the last turn the history is ~90% of the prompt. `unique`: the same schedule
and prompt lengths, every prompt fresh random tokens (nothing to reuse: what the tiers'
writes cost).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

WORKLOADS = ("multiturn", "unique")
TOPOLOGIES = ("both", "pd")
# The servers of a run, in this order: Tandem's device pool alone, with the host tier, with a
# host tier a third of the working set plus a disk tier, then vLLM-CPU with the same pool.
MODES = ("offload_off", "host", "host_disk", "vllm_cpu")
TANDEM_MODES = MODES[:3]
SPARE_BLOCKS = 4  # auto pool: the turns in flight at their longest, plus these


@dataclass(frozen=True)
class Config:
    """Everything a run depends on; `bench.multiturn.parse_args` builds it."""

    model: str = "llama-32m"  # a bench model's name (bench/models.py) or a folder
    workloads: tuple[str, ...] = WORKLOADS
    modes: tuple[str, ...] = MODES
    conversations: int = 8
    turns: int = 8
    system_len: int = 64
    user_len: int = 32
    max_tokens: int = 96
    max_in_flight: int = 2
    topology: str = "both"  # Tandem: one `both` worker, or "pd": a prefill and a decode worker
    block_size: int = 16
    num_blocks: int = 0  # 0: the turns in flight at their longest + SPARE_BLOCKS
    host_bytes: str = "512MiB"  # mode `host`: a tier that holds every conversation
    host_disk_blocks: int = 0  # mode `host_disk`: its host tier (0: a third of the working set)
    disk_bytes: str = "1GiB"  # mode `host_disk`: a disk tier that holds every conversation
    seed: int = 0
    request_timeout_s: float = 300.0
    out: str = ""

    def __post_init__(self) -> None:
        for name in ("conversations", "turns", "user_len", "max_tokens", "max_in_flight"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"topology must be one of {TOPOLOGIES}, got {self.topology!r}")
        if unknown := set(self.workloads) - set(WORKLOADS):
            raise ValueError(f"unknown workloads {sorted(unknown)}; known: {WORKLOADS}")
        if unknown := set(self.modes) - set(MODES):
            raise ValueError(f"unknown modes {sorted(unknown)}; known: {MODES}")

    def prompt_len(self, turn: int) -> int:
        """Tokens of turn `turn`'s prompt (0-based): system, every earlier exchange, a
        new user message."""
        return self.system_len + (turn + 1) * self.user_len + turn * self.max_tokens

    @property
    def longest_turn(self) -> int:
        """Tokens of the last turn, its answer included (the servers' max_model_len)."""
        return self.prompt_len(self.turns - 1) + self.max_tokens

    @property
    def history_blocks(self) -> int:
        """Full blocks of one conversation's history after its last answer."""
        return self.longest_turn // self.block_size

    @property
    def pool_blocks(self) -> int:
        if self.num_blocks:
            return self.num_blocks
        longest = -(-self.longest_turn // self.block_size)
        return self.max_in_flight * longest + SPARE_BLOCKS

    @property
    def working_set_blocks(self) -> int:
        """Distinct full blocks of every conversation's final history (the system
        prompt's counted once)."""
        system = self.system_len // self.block_size
        return system + self.conversations * (self.history_blocks - system)

    @property
    def host_tier_blocks(self) -> int:
        """The host tier of mode `host_disk`: deliberately smaller than the working set."""
        return self.host_disk_blocks or -(-self.working_set_blocks // 3)

    @property
    def history_share(self) -> float:
        """Over the returning turns: the share of prompt tokens an earlier turn computed."""
        returning = range(1, self.turns)
        reused = sum(reusable_len(self, k) for k in returning)
        total = sum(self.prompt_len(k) for k in returning)
        return reused / total if total else 0.0


def reusable_len(config: Config, turn: int) -> int:
    """Prompt tokens of turn `turn` of a conversation that earlier turns computed, in full
    blocks: the previous turn's prompt and answer but its last token (sampled, never fed
    back), or on a first turn the system prompt. What a cache that forgets nothing serves."""
    if turn == 0:
        known = config.system_len
    else:
        known = config.prompt_len(turn - 1) + config.max_tokens - 1
    return known // config.block_size * config.block_size


def kv_block_bytes(model_config: dict, block_size: int, dtype_bytes: int = 4) -> int:
    """Bytes of one KV block of a model (its config.json; float32 KV by default): K and V
    of every layer."""
    heads = model_config["num_attention_heads"]
    head_dim = model_config.get("head_dim") or model_config["hidden_size"] // heads
    kv_heads = model_config.get("num_key_value_heads", heads)
    layers = model_config["num_hidden_layers"]
    return layers * 2 * kv_heads * head_dim * block_size * dtype_bytes


@dataclass(frozen=True)
class Conversation:
    index: int
    system: tuple[int, ...]
    users: tuple[tuple[int, ...], ...]  # one new message per turn
    fresh: tuple[tuple[int, ...], ...] = ()  # `unique`: a whole prompt per turn instead


def build_conversations(config: Config, vocab: Sequence[int], workload: str) -> list[Conversation]:
    """The conversations of `workload`, deterministic for the config's seed."""
    rng = random.Random(f"{config.seed}-{workload}")
    system = tuple(rng.choices(vocab, k=config.system_len))
    out = []
    for index in range(config.conversations):
        users = tuple(tuple(rng.choices(vocab, k=config.user_len)) for _ in range(config.turns))
        fresh = ()
        if workload == "unique":
            fresh = tuple(
                tuple(rng.choices(vocab, k=config.prompt_len(t))) for t in range(config.turns)
            )
        out.append(Conversation(index, system, users, fresh))
    return out


def reusable_tokens(config: Config, conversation: Conversation, turn: int) -> int:
    """`reusable_len` of a conversation's turn; none in `unique`."""
    return 0 if conversation.fresh else reusable_len(config, turn)


def turn_prompt(
    conversation: Conversation, turn: int, answers: Sequence[Sequence[int]]
) -> list[int]:
    """Turn `turn`'s prompt: the system prompt, each earlier user message and its answer,
    the new user message (`unique`: its own fresh prompt)."""
    if conversation.fresh:
        return list(conversation.fresh[turn])
    ids = list(conversation.system)
    for user, answer in zip(conversation.users[:turn], answers, strict=True):
        ids += [*user, *answer]
    return ids + list(conversation.users[turn])
