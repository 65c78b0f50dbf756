"""Speculative decoding on one screen: greedy, batch 1, a draft model drafting chains of k tokens.

Read this first (after docs/design.md): it is what the engine does for one greedy request, without batching,
lanes, trees, sampling, processors or drafters' protocol. tests/test_reference_decoder.py holds the engine
to it token for token and step for step.
"""


def reference_generate(target, draft, prompt: list[int], max_new: int, k: int) -> tuple[list[int], list[int]]:
    """-> (the new tokens, the draft tokens accepted at each step). ``target``, ``draft``: models behind
    the model interface (models/base.py)."""
    t_rows, d_rows = target.new_rows(), draft.new_rows()
    t_rows.add_rows([prompt[:-1]])  # every cache holds all tokens but the last: the "pending" one
    d_rows.add_rows([prompt[:-1]])
    tokens, accepted = list(prompt), []
    while len(tokens) - len(prompt) < max_new:
        n = min(k, max_new - (len(tokens) - len(prompt)) - 1)  # never draft past the last token to emit
        guess, feed = [], tokens[d_rows.lens[0] :]  # the draft catches up on what it has not seen
        for _ in range(n):
            logits = d_rows.forward([feed], keep=1)[0, -1]
            d_rows.commit([len(feed)])
            guess.append(int(logits.argmax()))
            feed = guess[-1:]
        # the target scores the pending token and every guess in ONE forward
        choice = t_rows.forward([[tokens[-1]] + guess])[0].argmax(-1).tolist()
        a = 0
        while a < n and guess[a] == choice[a]:  # keep the guesses the target would have chosen itself
            a += 1
        t_rows.commit([1 + a])  # the pending token and the accepted guesses enter the target's cache
        d_rows.truncate(0, len(tokens) + a - 1)  # the draft forgets its rejected guesses
        d_rows.trim()
        tokens += guess[:a] + [choice[a]]  # plus the target's own next token: a step emits a + 1 tokens
        accepted.append(a)
    return tokens[len(prompt) :], accepted
