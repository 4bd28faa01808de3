"""What an ending adds to a turn's messages, whoever ends it, so that every stored history is
a valid conversation; what a relay that kept more of an ended turn's text adds later; and what
of an ended turn's text is stored beside its messages (only what they do not hold)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

from hangar.shared.protocol import (
    TERMINAL_STATUSES,
    TOOL_CANCELLED,
    TOOL_LOST,
    ChatMessage,
    TurnStatus,
)

if TYPE_CHECKING:
    from .store import TurnRecord


class MessageRefused(ValueError):
    """A drone's message that would leave the turn's history no valid conversation."""


NOT_THE_DRONES = "A drone sends only the model's and the tools' messages."
ANSWERS_NO_CALL = "This tool result answers no call of the turn."
CALLS_UNANSWERED = "The turn's tool calls need their results before the next message."
SAME_CALL_ID = "Two tool calls of the message have one id."
SAYS_NOTHING = "An assistant message needs its text or its tool calls."
NOT_A_RESULT = "Only a tool result answers a call, and a tool result makes no calls."

Shape = tuple[str, str | None, str, int | None]
"""What the order of a conversation depends on in a message: its role, the call it answers, the
ids of the calls it makes (a JSON array), and its number among the drone's messages."""

SHAPES = {
    dialect: f"SELECT role, answers, calls, number FROM messages WHERE turn_id = {mark}"
    " ORDER BY message_id"
    for dialect, mark in (("sqlite", "?"), ("postgres", "$1"))
}
"""A turn's stored messages as ``Shape`` rows, oldest first: what a drone's new message is
checked against, from columns written with each message (``shape_columns``). Read from each
message's body, a reply of 900 calls was parsed whole for each of their results."""


def shape_columns(message: ChatMessage) -> tuple[str, str | None, str]:
    """A message's ``Shape`` but its number, as stored beside it."""
    calls = json.dumps([call.id for call in message.tool_calls or ()])
    return message.role, message.tool_call_id, calls


def unstored(
    stored: Sequence[Shape], numbered: Sequence[tuple[int | None, ChatMessage]]
) -> tuple[list[ChatMessage], list[int | None]]:
    """Of a drone's numbered messages, those a turn whose messages are ``stored`` (its user
    message first) lacks, with their numbers: one sent again after a lost answer is stored
    once. A message that would not follow the turn's conversation (a tool result that answers
    no waiting call or makes calls, the model speaking before its calls have their results,
    answering a call or saying nothing, a person's or system message) raises
    ``MessageRefused``: the history stays one a model accepts."""
    waiting: set[str] = set()  # the calls of the last message that makes any, unanswered
    for role, answers, calls, _ in stored:
        if role == "tool":
            waiting.discard(answers or "")
        elif calls != "[]":
            waiting = set(json.loads(calls))
    numbers = {number for *_, number in stored if number is not None}
    count = len(stored)  # a turn stored before messages kept their numbers goes by its count
    fresh: list[ChatMessage] = []
    kept: list[int | None] = []
    for number, message in numbered:
        if number is not None and (number in numbers or (not numbers and number < count - 1)):
            continue
        ids = [call.id for call in message.tool_calls or ()]
        if (message.role == "tool" and ids) or (message.role != "tool" and message.tool_call_id):
            raise MessageRefused(NOT_A_RESULT)
        if message.role == "tool":
            if message.tool_call_id not in waiting:
                raise MessageRefused(ANSWERS_NO_CALL)
            waiting.discard(message.tool_call_id)
        elif message.role != "assistant":
            raise MessageRefused(NOT_THE_DRONES)
        elif waiting:
            raise MessageRefused(CALLS_UNANSWERED)
        elif len(set(ids)) < len(ids):
            raise MessageRefused(SAME_CALL_ID)
        elif not ids and not message.content:  # some services refuse it in a history
            raise MessageRefused(SAYS_NOTHING)
        else:
            waiting = set(ids)
        fresh.append(message)
        kept.append(number)
        if number is not None:
            numbers.add(number)
        count += 1
    return fresh, kept


def closing_messages(
    messages: list[ChatMessage], text: str, status: TurnStatus
) -> tuple[list[ChatMessage], str, str]:
    """What an ending adds to a turn's messages so that the history stays a valid
    conversation, the turn's text, and what of it to store (``kept_text``), whoever ends the
    turn (the drone, or the relay when the drone was lost, did not answer, or the relay
    restarted).

    - Text that streamed beyond what the messages hold (the drone was lost mid-answer) is kept
      as an assistant message flagged ``aborted``: the person saw it, the next turn knows it.
      (A finished turn's messages are the drone's own, complete.)
    - Every tool call without a result gets one: "cancelled" for an abort, ``TOOL_LOST`` for
      any other ending.

    The turn's text is the longer of the streamed text and the messages' (a relay that
    restarted mid-turn may have lost the streamed text; the messages are durable), and the
    messages' when the streamed text does not begin with theirs (Redis came back empty and
    holds only what streamed since).
    """
    said = assistant_text(messages)
    answered = {m.tool_call_id for m in messages if m.role == "tool"}
    result = TOOL_CANCELLED if status == "aborted" else TOOL_LOST
    added = [
        ChatMessage(role="tool", content=result, tool_call_id=call.id, name=call.name)
        for message in messages
        for call in message.tool_calls or []
        if call.id not in answered
    ]
    if not text.startswith(said):
        text = said  # the streamed text has a gap (Redis came back empty): the messages hold it
    if status != "finished" and len(text) > len(said):
        added.append(ChatMessage(role="assistant", content=text[len(said) :], aborted=True))
    text = text if len(text) > len(said) else said
    return added, text, kept_text([*messages, *added], text)


def filled_text(
    messages: list[ChatMessage], stored: str, text: str
) -> tuple[bool, list[ChatMessage], str] | None:
    """What an ended turn gains from a relay that kept more of its text than the ending had
    (the turn was ended by another relay while Redis, which holds running turns' text, was
    away, or before the drone's last text reached the drone's relay): the rest as an assistant
    message flagged ``aborted``. When the turn already ends with such a
    message (no tool calls), that one grows instead: ``(True, [grown], kept)`` says to store it
    in place of the last one, so the history never holds two answers in a row. ``kept`` is the
    turn's text to store (``kept_text``). None when ``text`` does not extend what is stored
    (``stored``: the turn's own text, empty when its messages hold it)."""
    said = assistant_text(messages)
    if len(text) <= max(len(stored), len(said)) or not text.startswith(said):
        return None
    if not text.startswith(stored):
        return None
    rest = text[len(said) :]
    last = messages[-1] if messages else None
    if last is not None and last.role == "assistant" and last.aborted and not last.tool_calls:
        grown = [last.model_copy(update={"content": last.content + rest})]
        return True, grown, kept_text([*messages[:-1], *grown], text)
    added = [ChatMessage(role="assistant", content=rest, aborted=True)]
    return False, added, kept_text([*messages, *added], text)


def assistant_text(messages: Sequence[ChatMessage]) -> str:
    """The model's words in ``messages``, in order: an ended turn's text, unless it stores its
    own (``kept_text``)."""
    return "".join(m.content for m in messages if m.role == "assistant")


def kept_text(messages: Sequence[ChatMessage], text: str) -> str:
    """What an ended turn whose messages are ``messages`` stores as its text: nothing when the
    messages hold it, as they do after every ending (``closing_messages``, ``filled_text``) but
    a finished one whose streamed text went past its messages. An answer is stored once; a read
    gives an ended turn with no text of its own its messages' (``assistant_text``)."""
    return "" if text == assistant_text(messages) else text


def with_texts(turns: list[TurnRecord]) -> list[TurnRecord]:
    """Turns read with their messages, each ended one with its text: one whose messages hold its
    text stores none of its own (``kept_text``)."""
    for turn in turns:
        if turn.status in TERMINAL_STATUSES and not turn.text:
            turn.text = assistant_text(turn.messages)
    return turns


DROP_LAST = (
    "DELETE FROM messages WHERE message_id = "
    "(SELECT max(message_id) FROM messages WHERE turn_id = {})"
)
"""The turn's last message goes, to be stored again grown (``filled_text``)."""
DROP_PIECES = "DELETE FROM turn_pieces WHERE turn_id = {}"
"""An ending drops the running text its relay wrote as it streamed (``running_text``): the
turn's messages hold it now."""
