"""A ``/v1/chat/completions`` response, whole or as server-sent events, in OpenAI's (and vLLM's)
shape.

``ChatForm`` says what the choices show beyond their text: logprobs
(``gateway.openai_logprobs.ChatShape``), tool calls (``gateway.tool_calls``: each choice's output
its calls), with vLLM's ``return_token_ids`` the prompt's ``prompt_token_ids`` (streamed: on the
first chunk) and each choice's generated ``token_ids`` (streamed: each chunk's own tokens), and with
``continuous_usage_stats`` each chunk's ``usage``: the prompt's tokens and its choice's so far.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass

from gateway.openai_choices import Choices, choice_usage
from gateway.openai_generation import RequestTotals, ResponseMeta, Responses, Totals, chained, event_stream
from gateway.openai_logprobs import ChatShape
from gateway.openai_models import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatLogprobs,
    Delta,
    FinishReason,
)
from gateway.tool_calls import ToolCallStream, ToolMode
from pdserve.v1 import gateway_pb2, sampling_pb2


@dataclass(frozen=True)
class ChatForm:
    shape: ChatShape | None = None
    tools: ToolMode | None = None
    prompt_ids: Sequence[int] | None = None  # the prompt's ids, with return_token_ids
    continuous_usage: bool = False  # every chunk with its choice's usage so far

    def token_ids(self, ids: Sequence[int]) -> list[int] | None:
        return None if self.prompt_ids is None else list(ids)


def chat_completion(
    meta: ResponseMeta, totals: RequestTotals, form: ChatForm | None = None
) -> ChatCompletion:
    form = form or ChatForm()
    choices = []
    prompt_logprobs: list[sampling_pb2.TokenLogprobs] = []
    for index, totals_i in totals.by_index():
        reason = totals_i.finish_reason or "stop"
        message = AssistantMessage(content=totals_i.text)
        if form.tools is not None:
            calls = form.tools.calls(totals_i.text)
            if calls is not None:
                message = AssistantMessage(content="", tool_calls=calls)
            reason = form.tools.finish(reason, calls)
        choice = ChatChoice(
            index=index,
            message=message,
            finish_reason=reason,
            stop_reason=totals_i.stop_reason,
            token_ids=form.token_ids(totals_i.token_ids),
        )
        if form.shape is not None:
            choice.logprobs = form.shape.render(totals_i.token_ids, totals_i.logprobs)
        prompt_logprobs = prompt_logprobs or totals_i.prompt_logprobs
        choices.append(choice)
    body = ChatCompletion(
        id=meta.id, created=meta.created, model=meta.model, choices=choices, usage=totals.usage()
    )
    if form.shape is not None:
        body.prompt_logprobs = form.shape.prompt_field(prompt_logprobs)
    if form.prompt_ids is not None:
        body.prompt_token_ids = list(form.prompt_ids)
    return body


def chat_events(
    meta: ResponseMeta,
    first: gateway_pb2.GenerateResponse,
    rest: Responses,
    include_usage: bool,
    form: ChatForm | None = None,
) -> AsyncGenerator[str, None]:
    form = form or ChatForm()
    totals = Choices(Totals)

    def usage() -> ChatCompletionChunk | None:
        if not include_usage:
            return None
        return ChatCompletionChunk(
            id=meta.id, created=meta.created, model=meta.model, choices=[], usage=totals.usage()
        )

    return event_stream(_ChatChunks(meta, totals, form).of(chained(first, rest)), rest, usage)


class _ChatChunks:
    """A chat stream's chunks: a choice's role first, its text (or tool calls) as it comes, its
    finish; the prompt's ids (``return_token_ids``) on the very first chunk."""

    def __init__(self, meta: ResponseMeta, totals: RequestTotals, form: ChatForm) -> None:
        self._meta = meta
        self._totals = totals
        self._form = form
        self._prompt_ids = None if form.prompt_ids is None else list(form.prompt_ids)

    def chunk(
        self,
        index: int,
        delta: Delta,
        reason: FinishReason | None = None,
        logprobs: ChatLogprobs | None = None,
        token_ids: Sequence[int] = (),
        role: bool = False,
    ) -> ChatCompletionChunk:
        stop = self._totals.choice(index).stop_reason if reason is not None else None
        choice = ChatChunkChoice(
            index=index,
            delta=delta,
            finish_reason=reason,
            logprobs=logprobs,
            stop_reason=stop,
            token_ids=self._form.token_ids(token_ids),
        )
        meta = self._meta
        usage = choice_usage(self._totals, index, before=role) if self._form.continuous_usage else None
        body = ChatCompletionChunk(
            id=meta.id,
            created=meta.created,
            model=meta.model,
            choices=[choice],
            usage=usage,
            prompt_token_ids=self._prompt_ids,
        )
        self._prompt_ids = None
        return body

    async def of(self, responses: Responses) -> AsyncGenerator[ChatCompletionChunk, None]:
        totals, form, chunk = self._totals, self._form, self.chunk
        calls = ToolCallStream(form.tools) if form.tools is not None else None
        async for response in responses:
            first = totals.is_new(response.index)
            reason = totals.add(response)
            if first:  # a choice's first chunk gives the role
                yield chunk(response.index, Delta(role="assistant", content=""), role=True)
            logprobs = None
            if form.shape is not None and form.shape.top_logprobs is not None and response.token_ids:
                logprobs = form.shape.render(response.token_ids, response.logprobs)
            tokens = response.token_ids
            if calls is None:
                if logprobs is not None or response.text or tokens:
                    yield chunk(
                        response.index, Delta(content=response.text), logprobs=logprobs, token_ids=tokens
                    )
                if reason is not None:
                    yield chunk(response.index, Delta(), reason)
                continue
            part = calls.part(response.index, response.text) if response.text or tokens else None
            if part is not None:
                yield chunk(response.index, Delta(tool_calls=part), logprobs=logprobs, token_ids=tokens)
            if reason is not None:
                text = totals.choice(response.index).text
                every = totals.choice(response.index).token_ids  # required's: none streamed before
                whole, made = calls.whole(text)
                if whole is not None:
                    yield chunk(response.index, Delta(tool_calls=whole), token_ids=every)
                elif calls.mode.required and text:
                    yield chunk(response.index, Delta(content=text), token_ids=every)  # cut short
                yield chunk(response.index, Delta(), calls.mode.finish(reason, made))
