"""A ``/v1/completions`` response, whole or as server-sent events, in OpenAI's (and vLLM's) shape.

``CompletionForm`` says what the choices show beyond their text: each prompt's echo and logprobs
(``gateway.openai_logprobs.CompletionShape``), with vLLM's ``return_token_ids`` each choice's
``prompt_token_ids`` and generated ``token_ids`` (streamed: the prompt's ids with a choice's first
chunk, each chunk's own tokens), and with ``continuous_usage_stats`` each chunk's ``usage``: its
prompt's tokens and its choice's tokens so far, as vLLM counts them. A batch's prompt ``p`` holds the choices ``p * per_prompt`` onward
(``gateway.prompt_batch``).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass

from gateway.openai_choices import Choices, choice_usage
from gateway.openai_generation import RequestTotals, ResponseMeta, Responses, Totals, chained, event_stream
from gateway.openai_logprobs import CompletionShape
from gateway.openai_models import Completion, CompletionChoice
from pdserve.v1 import gateway_pb2


@dataclass(frozen=True)
class CompletionForm:
    per_prompt: int = 1  # the choices of each prompt (n)
    shapes: Sequence[CompletionShape] = ()  # each prompt's (none: the text alone)
    prompt_ids: Sequence[Sequence[int]] | None = None  # each prompt's ids, with return_token_ids
    hidden_token: bool = False  # echo with max_tokens 0: the one token run is not the output
    continuous_usage: bool = False  # every chunk with its choice's usage so far

    def shape(self, index: int) -> CompletionShape | None:
        return self.shapes[index // self.per_prompt] if self.shapes else None

    def prompt_token_ids(self, index: int) -> list[int] | None:
        return None if self.prompt_ids is None else list(self.prompt_ids[index // self.per_prompt])

    def token_ids(self, ids: Sequence[int]) -> list[int] | None:
        if self.prompt_ids is None:
            return None
        return [] if self.hidden_token else list(ids)


def completion(meta: ResponseMeta, totals: RequestTotals, form: CompletionForm | None = None) -> Completion:
    form = form or CompletionForm()
    choices = []
    for index, totals_i in totals.by_index():
        shape = form.shape(index)
        choice = CompletionChoice(
            index=index,
            text=totals_i.text,
            finish_reason=totals_i.finish_reason or "stop",
            stop_reason=totals_i.stop_reason,
            prompt_token_ids=form.prompt_token_ids(index),
            token_ids=form.token_ids(totals_i.token_ids),
        )
        if shape is not None:
            choice.text, choice.logprobs = shape.render(
                totals_i.text, totals_i.token_ids, totals_i.logprobs, totals_i.prompt_logprobs, first=True
            )
            choice.prompt_logprobs = shape.prompt_field(totals_i.prompt_logprobs)
        choices.append(choice)
    return Completion(
        id=meta.id, created=meta.created, model=meta.model, choices=choices, usage=totals.usage()
    )


def completion_events(
    meta: ResponseMeta,
    first: gateway_pb2.GenerateResponse,
    rest: Responses,
    include_usage: bool,
    form: CompletionForm | None = None,
) -> AsyncGenerator[str, None]:
    form = form or CompletionForm()
    totals = Choices(Totals, form.per_prompt)

    def usage() -> Completion | None:
        if not include_usage:
            return None
        return Completion(
            id=meta.id, created=meta.created, model=meta.model, choices=[], usage=totals.usage()
        )

    return event_stream(_chunks(meta, chained(first, rest), totals, form), rest, usage)


async def _chunks(
    meta: ResponseMeta, responses: Responses, totals: RequestTotals, form: CompletionForm
) -> AsyncGenerator[Completion, None]:
    async for response in responses:
        shape = form.shape(response.index)
        is_first = totals.is_new(response.index)
        offset = len(totals.choice(response.index).text)
        reason = totals.add(response)
        choice = CompletionChoice(
            index=response.index,
            text=response.text,
            finish_reason=reason,
            stop_reason=totals.choice(response.index).stop_reason,
            prompt_token_ids=form.prompt_token_ids(response.index) if is_first else None,
            token_ids=form.token_ids(response.token_ids),
        )
        if shape is not None:
            choice.text, choice.logprobs = shape.render(
                response.text,
                response.token_ids,
                response.logprobs,
                response.prompt_logprobs,
                first=is_first,
                offset=offset,
            )
        if choice.text or reason is not None or response.token_ids:
            usage = choice_usage(totals, response.index) if form.continuous_usage else None
            yield Completion(
                id=meta.id, created=meta.created, model=meta.model, choices=[choice], usage=usage
            )
