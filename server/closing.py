"""What an ending adds to a turn's messages, whoever ends it, so that every stored history is
a valid conversation; and what a relay that kept more of an ended turn's text adds later."""

from __future__ import annotations

from collections.abc import Sequence

from hangar.shared.protocol import TOOL_CANCELLED, TOOL_LOST, ChatMessage, TurnStatus


def unstored(stored: int, numbered: Sequence[tuple[int, ChatMessage]]) -> list[ChatMessage]:
    """Of a drone's numbered messages, those a turn with ``stored`` messages (its user message
    first) lacks: one sent again after a lost answer is stored once."""
    fresh: list[ChatMessage] = []
    for number, message in numbered:
        if stored - 1 <= number:
            fresh.append(message)
            stored += 1
    return fresh


def closing_messages(
    messages: list[ChatMessage], text: str, status: TurnStatus
) -> tuple[list[ChatMessage], str]:
    """What an ending adds to a turn's messages so that the history stays a valid
    conversation, and the text to store, whoever ends the turn (the drone, or the relay when the
    drone was lost, did not answer, or the relay restarted).

    - Text that streamed beyond what the messages hold (the drone was lost mid-answer) is kept
      as an assistant message flagged ``aborted``: the person saw it, the next turn knows it.
      (A finished turn's messages are the drone's own, complete.)
    - Every tool call without a result gets one: "cancelled" for an abort, ``TOOL_LOST`` for
      any other ending.

    The text stored is the longer of the streamed text and the messages' (a relay that
    restarted mid-turn may have lost the streamed text; the messages are durable), and the
    messages' when the streamed text does not begin with theirs (Redis came back empty and
    holds only what streamed since).
    """
    said = "".join(m.content for m in messages if m.role == "assistant")
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
    return added, text if len(text) > len(said) else said


def filled_text(
    messages: list[ChatMessage], stored: str, text: str
) -> tuple[bool, list[ChatMessage], str] | None:
    """What an ended turn gains from a relay that kept more of its text than the ending had
    (the turn was ended by another relay while Redis, which holds running turns' text, was
    away, or before the drone's last text reached the drone's relay): the rest as an assistant
    message flagged ``aborted``, and the whole text. When the turn already ends with such a
    message (no tool calls), that one grows instead: ``(True, [it, grown], text)`` says to store
    it in place of the last one, so the history never holds two answers in a row. None when
    ``text`` does not extend what is stored."""
    said = "".join(m.content for m in messages if m.role == "assistant")
    if len(text) <= max(len(stored), len(said)) or not text.startswith(said):
        return None
    if not text.startswith(stored):
        return None
    rest = text[len(said) :]
    last = messages[-1] if messages else None
    if last is not None and last.role == "assistant" and last.aborted and not last.tool_calls:
        return True, [last.model_copy(update={"content": last.content + rest})], text
    return False, [ChatMessage(role="assistant", content=rest, aborted=True)], text


DROP_LAST = (
    "DELETE FROM messages WHERE message_id = "
    "(SELECT max(message_id) FROM messages WHERE turn_id = {})"
)
"""The turn's last message goes, to be stored again grown (``filled_text``)."""
