"""responses_client.py BASE_URL MODE TIMEOUT - one request to OpenAI's Responses API through the
official `openai` package, as an application sends it, with a timeout of TIMEOUT s and no
retry. BASE_URL is the API root, e.g. http://127.0.0.1:8080/v1. MODE is one of, each asking
"hello" or, after a colon, the text of a file (stream:FILE):
    plain   responses.create(...)
    stream  responses.create(stream=True, ...), every event read
    helper  responses.stream(...), the package's stream helper, which checks that the stream
            opens with response.created and stays one response; every event read, then its
            final response (its id in "ids"). It needs events with output_index, which
            llama-server's lack.
A stream's "ids" are those of the responses its events name, in order, each once.

Prints one line of JSON and exits 0 when the answer came whole:
    {"text": "...", "status": "...", "events": [TYPE, ...]}
where status is the response's (for a stream, that of its response.completed, .failed or
.incomplete event; null when none came);
or exits 1 when the package raised one of its errors (APIError for an error event that
carries an error object, APIStatusError and its subclasses for an error answer, ...):
    {"error": "CLASS", "message": "...", "status": N or null, "body": ...}
Exits 2 on a usage error or when the openai package is missing (tests/clients/prepare makes a
venv that has it).
"""

import json
import sys


def jsonable(v):
    try:
        return json.loads(json.dumps(v))
    except (TypeError, ValueError):
        return repr(v)


def main():
    mode, _, prompt_file = sys.argv[2].partition(":") if len(sys.argv) > 2 else ("", "", "")
    if len(sys.argv) != 4 or mode not in ("plain", "stream", "helper"):
        print(f"usage: {sys.argv[0]} BASE_URL plain|stream|helper[:FILE] TIMEOUT",
              file=sys.stderr)
        sys.exit(2)
    base_url, timeout = sys.argv[1], float(sys.argv[3])
    prompt = "hello"
    if prompt_file:
        with open(prompt_file) as f:
            prompt = f.read()
    try:
        import openai
    except ImportError as e:
        print(f"responses_client: {sys.executable} has no openai package ({e})", file=sys.stderr)
        sys.exit(2)
    client = openai.OpenAI(base_url=base_url, api_key="none", timeout=timeout, max_retries=0)
    request = {"model": "dsv4", "input": prompt, "max_output_tokens": 8}
    try:
        if mode == "plain":
            r = client.responses.create(**request)
            out = {"text": r.output_text, "status": r.status, "events": []}
        elif mode == "helper":
            events = []
            with client.responses.stream(**request) as stream:
                for event in stream:
                    events.append(event.type)
                final = stream.get_final_response()
            out = {"text": final.output_text, "status": final.status, "events": events,
                   "ids": [final.id]}
        else:
            text, status, events, ids = [], None, [], []
            for event in client.responses.create(stream=True, **request):
                events.append(event.type)
                named = getattr(getattr(event, "response", None), "id", None)
                if named and named not in ids:
                    ids.append(named)
                if event.type == "response.output_text.delta":
                    text.append(event.delta)
                elif event.type in ("response.completed", "response.failed",
                                    "response.incomplete"):
                    status = event.response.status
            out = {"text": "".join(text), "status": status, "events": events, "ids": ids}
    except openai.APIError as e:
        print(json.dumps({"error": type(e).__name__, "message": e.message,
                          "status": getattr(e, "status_code", None),
                          "body": jsonable(e.body)}))
        sys.exit(1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
