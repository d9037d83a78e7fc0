"""The loads ``bench serve --engine vllm`` can send besides independent prompts (issue 68 item 5):
what people serve, where prompts share their beginnings and prefix caching pays.

- ``random`` (the default): independent prompts cut from the held-out text (``serve.make_requests``).
- ``shared-prefix``: ``--prefixes`` system prompts of ``--prefix-len`` tokens, each followed by
  ``--requests / --prefixes`` different questions of ``--prompt-len`` tokens (all cut from the
  held-out text at seeded offsets), sent in a seeded order: chat assistants, few-shot prompts,
  agents and retrieval templates look like this.
- ``chat``: ``--requests / --turns`` conversations of ``--turns`` turns. A conversation's first
  prompt is ``--prompt-len`` tokens; each later turn resends the conversation so far (every earlier
  prompt and the tokens the server generated for it) plus ``--prompt-len`` new tokens, and is sent
  when the turn before it has finished. Conversations run side by side.

Both count the token ids only: a "system prompt" is held-out text, not a chat template.
"""

from __future__ import annotations

import random

from ..errors import UserError

WORKLOADS = ("random", "shared-prefix", "chat")


def _cut(ids: list[int], n: int, rng: random.Random) -> list[int]:
    if len(ids) <= n:
        raise UserError(f"the held-out text has {len(ids)} tokens, fewer than a piece of {n}")
    start = rng.randrange(0, len(ids) - n)
    return ids[start:start + n]


def shared_prefix_requests(ids: list[int], requests: int, prefixes: int, prefix_len: int, prompt_len: int,
                           output_len: int, seed: int) -> list[dict]:
    """``requests`` prompts: prefix k (of ``prefixes``) + a question of its own, in a seeded order."""
    if prefixes < 1 or prefix_len < 1 or requests < prefixes:
        raise UserError(f"--workload shared-prefix needs --prefixes >= 1, --prefix-len >= 1 and at least one "
                        f"request a prefix (got {prefixes} prefixes, {requests} requests)")
    rng = random.Random(seed)
    heads = [_cut(ids, prefix_len, rng) for _ in range(prefixes)]
    out = [{"prompt": heads[i % prefixes] + _cut(ids, prompt_len, rng), "max_tokens": output_len, "prefix": i % prefixes}
           for i in range(requests)]
    rng.shuffle(out)
    return out


def chat_turns(ids: list[int], requests: int, turns: int, prompt_len: int, seed: int) -> list[list[list[int]]]:
    """The new user text of each turn of each conversation: ``[conversation][turn] -> ids``."""
    if turns < 1 or requests < turns:
        raise UserError(f"--workload chat needs --turns >= 1 and at least one conversation "
                        f"(--requests {requests} < --turns {turns})")
    rng = random.Random(seed)
    return [[_cut(ids, prompt_len, rng) for _ in range(turns)] for _ in range(requests // turns)]


def longest(reqs: list[dict], output_len: int) -> int:
    """The longest sequence the load makes (a server's --max-model-len must hold it); a chat's
    requests are its conversations (``turns``), each turn answered with ``output_len`` tokens."""
    if "turns" in reqs[0]:
        return max(sum(len(t) for t in r["turns"]) + len(r["turns"]) * output_len for r in reqs)
    return max(len(r["prompt"]) + r["max_tokens"] for r in reqs)
