"""Do the recall task's reminders draw attention to the key? A recall prompt
(kvviz.model.needle.tasks.recall) read once with the full cache, eager attention: per layer,
the attention the key's positions receive (summed over them, averaged over query heads and
rows) from the query rows of the reminder sentences, against the rows between reminders
(after the first reminder, before the last, outside every reminder).

    .venv/bin/python -m lab.reminder_attention --length 300 --depth 10 --reminder-every 5 --seeds 0 1

A ratio above 1 in a layer: the reminders look back at the key more than the filler around them.
"""
from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass

import numpy as np


@dataclass
class ReminderAttention:
    at_reminders: np.ndarray  # (L,) mean attention the key's positions receive from reminder rows
    between: np.ndarray       # (L,) the same from the rows between reminders
    reminder_rows: list[int]
    between_rows: list[int]

    @property
    def ratio(self) -> np.ndarray:
        return self.at_reminders / self.between


def query_rows(reminders, prompt_len: int) -> tuple[list[int], list[int]]:
    """(the rows inside the reminders, the rows between the first reminder's end and the last
    one's start outside any reminder); ValueError with fewer than two reminders."""
    spans = sorted((int(a), int(b)) for a, b in reminders)
    if len(spans) < 2:
        raise ValueError(f"the prompt has {len(spans)} reminder(s); rows between reminders need two or more "
                         "(a smaller --reminder-every, a longer --length or a smaller --depth)")
    inside = [i for a, b in spans for i in range(a, b)]
    between = [i for i in range(spans[0][1], spans[-1][0]) if i not in set(inside)]
    if spans[0][0] < 0 or spans[-1][1] > prompt_len:
        raise ValueError(f"a reminder lies outside the prompt's {prompt_len} tokens")
    return inside, between


def key_attention_rows(attn: np.ndarray, key_positions) -> np.ndarray:
    """attn (L, H, T, T) rows summing to 1 -> (L, T): the attention each row (query step)
    pays to the key's positions, summed over the positions, averaged over heads."""
    a = np.asarray(attn, np.float64)[..., list(key_positions)]
    return a.sum(-1).mean(axis=1)


def key_attention(attn: np.ndarray, key_positions, rows) -> np.ndarray:
    """attn (L, H, T, T) rows summing to 1 -> (L,): the attention `rows` pay to the key's
    positions, summed over the positions, averaged over heads and rows."""
    return key_attention_rows(attn, key_positions)[:, list(rows)].mean(axis=1)


def eager_attention(mdl, ids) -> np.ndarray:
    """(L, H, T, T) float32: every layer's attention over the prompt, full cache, one eager
    forward pass with output_attentions (the model's implementation restored after)."""
    import torch

    previous = mdl.config._attn_implementation
    mdl.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = mdl(torch.tensor([list(ids)]), output_attentions=True).attentions
    finally:
        mdl.set_attn_implementation(previous)
    return np.stack([a[0].float().numpy() for a in out])


def reminder_attention(pair, prompt) -> ReminderAttention:
    """The figures for one recall prompt (a NeedlePrompt with reminders) on `pair` (tokenizer, model)."""
    inside, between = query_rows(prompt.reminders, len(prompt.ids))
    attn = eager_attention(pair[1], prompt.ids)
    return ReminderAttention(key_attention(attn, prompt.key_positions, inside),
                             key_attention(attn, prompt.key_positions, between), inside, between)


def table(results: list[ReminderAttention]) -> str:
    at = np.mean([r.at_reminders for r in results], axis=0)
    bt = np.mean([r.between for r in results], axis=0)
    lines = ["layer  at reminders  between  ratio"]
    lines += [f"{layer:5d}  {a:12.4f}  {b:7.4f}  {a / b:5.2f}" for layer, (a, b) in enumerate(zip(at, bt))]
    above = int((at / bt > 1).sum())
    lines.append(f"ratio > 1 in {above} of {len(at)} layers (means over {len(results)} prompt(s))")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.reminder_attention", description=__doc__.split("\n\n")[0])
    p.add_argument("--length", type=int, default=600, help="prompt length in tokens")
    p.add_argument("--depth", type=float, default=10, help="the key's depth, percent of the haystack")
    p.add_argument("--reminder-every", type=int, default=20, help="a reminder after every K-th sentence")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--model", help="a local model folder, .gguf or installed name (default: SmolLM2-135M)")
    p.add_argument("--threads", type=int, help="torch threads")
    args = p.parse_args(argv)
    try:
        from kvviz.model.needle.tasks import Task, recall

        Task("recall", reminder_every=args.reminder_every)
        from kvviz.model.models import load_model, load_tokenizer, thread_count, use_threads

        thread_count(args.threads)
        tok = load_tokenizer(args.model)
        prompts = [recall(tok, args.length, args.depth, s, args.reminder_every) for s in args.seeds]
        for pr in prompts:
            query_rows(pr.reminders, len(pr.ids))
    except ValueError as exc:  # the needle's messages name its --lengths; this study's option is --length
        message = re.sub(r"--lengths\b", "--length", str(exc))
        print(f"error: {message}", file=sys.stderr)
        return 2
    use_threads(args.threads, "reminder_attention")
    pair = load_model(args.model, "reminder_attention")
    print(table([reminder_attention(pair, pr) for pr in prompts]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
