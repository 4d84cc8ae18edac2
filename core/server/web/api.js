// The server's own routes, called with the API key the user gave (kept in this browser only).

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export class Api {
  /** @param {() => string} keyOf the current API key ("" for none) */
  constructor(keyOf) {
    this.keyOf = keyOf;
  }

  headers(json) {
    const headers = {};
    const key = this.keyOf();
    if (key) headers.Authorization = `Bearer ${key}`;
    if (json) headers["Content-Type"] = "application/json";
    return headers;
  }

  /** The JSON body of GET `path`; an ApiError with the server's message otherwise. */
  async get(path) {
    const response = await fetch(path, { headers: this.headers(false) });
    if (!response.ok) throw await errorOf(response);
    return response.json();
  }

  /** The chunks of a streamed chat completion; aborting `signal` closes the connection (the server
   * then aborts the request and frees its KV cache). */
  async *streamChat(body, signal) {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: this.headers(true), signal,
      body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }),
    });
    if (!response.ok) throw await errorOf(response);
    yield* events(response.body);
  }
}

async function errorOf(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    message = body.error?.message ?? body.detail ?? message;
  } catch { /* not JSON: keep the status line */ }
  return new ApiError(response.status, message);
}

/** The JSON payloads of an OpenAI SSE body, up to `[DONE]`; an error event raises. */
async function* events(stream) {
  const reader = stream.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    for (let cut = buffer.indexOf("\n\n"); cut >= 0; cut = buffer.indexOf("\n\n")) {
      const data = dataOf(buffer.slice(0, cut));
      buffer = buffer.slice(cut + 2);
      if (data === "[DONE]") return;
      if (!data) continue;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new ApiError(chunk.error.code ?? 500, chunk.error.message);
      yield chunk;
    }
  }
}

function dataOf(event) {
  return event.split("\n").filter((line) => line.startsWith("data:"))
    .map((line) => line.slice(5).trimStart()).join("\n");
}
