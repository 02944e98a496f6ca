"""A Responses stream that fails ends with an ``error`` event the official SDK's type accepts
(with the stream's next ``sequence_number``)."""

import json

from openai.types.responses import ResponseErrorEvent

from kvwise.server.protocol import APIError
from kvwise.server.responses_output import ResponseWriter


def test_the_error_event_is_numbered_and_parses():
    writer = ResponseWriter({"id": "resp_x"}, set(), stream=True)
    writer._event("response.created")  # one event before it
    text = writer.error(APIError(503, "the engine stopped", code="engine_down"))
    kind, data = text.strip().split("\n")
    assert kind == "event: error"
    event = ResponseErrorEvent.model_validate(json.loads(data.removeprefix("data: ")))
    assert (event.sequence_number, event.code, event.message) == (
        1,
        "engine_down",
        "the engine stopped",
    )
