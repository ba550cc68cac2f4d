"""The combination matrix's GRPO reward (tests/combinations.py): 1 for a completion holding the answer."""


def score(prompts, completions, answer, **kwargs):
    return [float(a in c) for c, a in zip(completions, answer)]
