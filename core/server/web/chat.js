// One chat turn on the wire: the request body built from a conversation and the settings (the server is
// stateless, so every turn sends the whole history), and streamed deltas folded into the reply.

const NUMBERS = ["temperature", "top_p", "max_tokens", "seed"];

/** The /v1/chat/completions body (without `stream`); throws when the tools setting is not JSON. */
export function requestBody(conversation, settings) {
  const messages = [];
  if (settings.system?.trim()) messages.push({ role: "system", content: settings.system });
  for (const message of conversation.messages) messages.push(wireMessage(message));
  const body = { messages };
  if (settings.model) body.model = settings.model;
  for (const name of NUMBERS) {
    if (String(settings[name] ?? "").trim() !== "") body[name] = Number(settings[name]);
  }
  if (settings.tools?.trim()) body.tools = parseTools(settings.tools);
  return body;
}

export function parseTools(text) {
  let tools;
  try {
    tools = JSON.parse(text);
  } catch (error) {
    throw new Error(`Tools must be a JSON list of OpenAI tools: ${error.message}`);
  }
  if (!Array.isArray(tools)) throw new Error("Tools must be a JSON list of OpenAI tools");
  return tools;
}

function wireMessage(message) {
  if (message.role === "assistant") {
    const wire = { role: "assistant", content: message.content };
    if (message.tool_calls?.length) wire.tool_calls = message.tool_calls;
    return wire;
  }
  if (!message.images?.length) return { role: message.role, content: message.content };
  const images = message.images.map((url) => ({ type: "image_url", image_url: { url } }));
  return { role: message.role, content: [...images, { type: "text", text: message.content }] };
}

/** A reply still empty. */
export function newReply() {
  return { role: "assistant", content: "", reasoning: "", tool_calls: [], finish: null, error: null };
}

/** Fold one streamed chunk into `reply`: content, reasoning_content, tool-call pieces, finish, usage. */
export function applyChunk(reply, chunk) {
  for (const choice of chunk.choices ?? []) {
    if (choice.index !== 0) continue;
    const delta = choice.delta ?? {};
    if (delta.content) reply.content += delta.content;
    if (delta.reasoning_content) reply.reasoning += delta.reasoning_content;
    for (const piece of delta.tool_calls ?? []) addToolCallPiece(reply.tool_calls, piece);
    if (choice.finish_reason) reply.finish = choice.finish_reason;
  }
  if (chunk.usage) reply.usage = chunk.usage;
}

function addToolCallPiece(calls, piece) {
  const call = calls[piece.index] ??= { id: "", type: "function", function: { name: "", arguments: "" } };
  if (piece.id) call.id = piece.id;
  if (piece.function?.name) call.function.name += piece.function.name;
  if (piece.function?.arguments) call.function.arguments += piece.function.arguments;
}
