"""Speculative decoding: proposers guess the next tokens, the target verifies them in one step.

    base.py        Proposer (abstract) and the registry of proposer kinds
    ngram.py       prompt lookup: the continuation of the latest earlier match of the context's suffix
    draft.py       a smaller model with the same tokenizer, its own paged KV cache, batched greedy drafts
    controller.py  how many tokens each request proposes this step (0: none), from measured goodput
    speculator.py  the one object the engine core calls: plan, propose, leave proposals on requests

Verification (exact, greedy and rejection sampling) lives in engine/sampler.py (`Sampler.verify`);
the scheduler schedules proposals as ordinary query tokens and rolls back past the rejected ones.
"""
