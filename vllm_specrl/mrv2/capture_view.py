"""One Model Runner V2 step's rows in the capture tap's terms, from what ``propose`` receives.

On Model Runner V2 (vLLM 0.34) a speculator's ``propose`` is called once per step, right after
sampling, with the step's batch, the target's hidden states of every scheduled row and, per
request, ``num_sampled`` (tokens sampled this step: accepted drafts plus one) and ``num_rejected``
(drafts rejected). Rows ``[start, end)`` of request i are ``[x_last, d_1..d_k]`` when it verifies
k drafts: the first ``end - start - num_rejected`` are committed, and the tokens committed after
them are the accepted drafts (``input_ids[start+1 : start+num_sampled]``) then this step's last
sample (``last_sampled``, already updated by the runner before ``propose``). A prefill chunk
commits every row; its last row is followed by the sample when the chunk ends the prompt
(``num_sampled`` 1), by an unknown token (-1) otherwise. The sampler's logits are not handed to a
speculator, so frames carry no logprobs here (``logits`` None): the trainer's loss then uses the
next tokens alone.
"""

from __future__ import annotations

from typing import Any


def mrv2_step_view(input_batch: Any, last_hidden_states: Any, aux_hidden_states: Any, num_sampled: Any,
                   num_rejected: Any, last_sampled: Any, prompt_lens: Any = None,
                   drafter: str = "eagle3") -> dict[str, Any] | None:
    """The tap's view of one step (``capture.tap.collect_step`` reads it). ``last_sampled`` is the
    runner's per-slot tensor (``[max_num_reqs]`` or ``[max_num_reqs, 1]``), read through the batch's
    ``idx_mapping``; ``prompt_lens`` the per-slot prompt lengths (``req_states.prompt_len.np``) or
    None. None for a step with no request."""
    num_reqs = int(input_batch.num_reqs)
    if num_reqs == 0:
        return None
    total = int(input_batch.num_tokens)
    starts = [int(s) for s in input_batch.query_start_loc_np[:num_reqs + 1]]
    slots = [int(s) for s in input_batch.idx_mapping_np[:num_reqs]]
    sampled_n = [int(n) for n in num_sampled[:num_reqs].tolist()]
    rejected_n = [int(n) for n in num_rejected[:num_reqs].tolist()]
    last = last_sampled.reshape(last_sampled.shape[0], -1)[:, 0]
    last_tokens = last[input_batch.idx_mapping[:num_reqs]].tolist()
    drafts = input_batch.num_draft_tokens_per_req
    ids = input_batch.input_ids[:total]
    ids_list = ids.tolist()
    requests = []
    for i, rid in enumerate(input_batch.req_ids[:num_reqs]):
        start, end = starts[i], starts[i + 1]
        num_spec = int(drafts[i]) if drafts is not None else 0
        n_sampled, n_rejected = sampled_n[i], rejected_n[i]
        if num_spec and n_sampled + n_rejected != end - start:
            raise ValueError(f"request {rid}: {n_sampled} sampled and {n_rejected} rejected do not fill its "
                             f"{end - start} verify rows: a row layout this view was not written for")
        if n_sampled == 0:
            sampled: list[int] = []
        elif num_spec:
            sampled = ids_list[start + 1:start + n_sampled] + [int(last_tokens[i])]
        else:
            sampled = [int(last_tokens[i])]
        request = {"request_id": rid, "start": start, "end": end, "num_spec": num_spec, "sampled": sampled,
                   "logit_row": 0}
        if prompt_lens is not None:
            request["num_prompt_tokens"] = int(prompt_lens[slots[i]])
        requests.append(request)
    return {"input_ids": ids, "positions": input_batch.positions[:total],
            "final_hidden": last_hidden_states[:total],
            "aux_hidden": [h[:total] for h in aux_hidden_states or ()],
            "drafter": drafter, "logits": None, "raw_logprobs": None, "requests": requests}


class CaptureTee:
    """Held by a capturing speculator: hands each real step's view to the installed tap. A tap's
    failure is counted and never reaches the engine step (capture must not stall generation)."""

    def __init__(self, drafter: str = "eagle3"):
        self.drafter = drafter
        self.tap: Any = None
        self.errors = 0
        self.last_error: str | None = None

    def offer(self, input_batch: Any, last_hidden_states: Any, aux_hidden_states: Any, num_sampled: Any,
              num_rejected: Any, last_sampled: Any, prompt_lens: Any = None) -> None:
        if self.tap is None:
            return
        try:
            view = mrv2_step_view(input_batch, last_hidden_states, aux_hidden_states, num_sampled, num_rejected,
                                  last_sampled, prompt_lens, self.drafter)
            if view is not None:
                self.tap(view)
        except Exception as exc:  # noqa: BLE001 - capture is best effort; generation goes on
            self.errors += 1
            self.last_error = repr(exc)
