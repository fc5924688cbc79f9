// The chat API as the page uses it: one streamed reply of /v1/chat/completions, read from the
// server-sent events into the think channel (delta.reasoning_content) and the answer
// (delta.content), and the note under a finished reply.
"use strict";

// Server-sent events from a fetch body: "data: {...}" lines, events split by a blank line.
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
      if (data === "[DONE]") return;
      if (data) yield JSON.parse(data);
    }
  }
}

async function errorText(response) {
  try {
    const body = await response.json();
    return body.error ? body.error.message : response.statusText;
  } catch (_) {
    return response.status + " " + response.statusText;
  }
}

// Streams the reply to a request into `reply` ({content, reasoning, timings, usage}), so that a
// stopped reply keeps what came; changed() after each piece of text.
async function streamReply(body, headers, reply, changed, signal) {
  const response = await fetch("/v1/chat/completions", {
    method: "POST", headers, body: JSON.stringify(body), signal });
  if (!response.ok) throw new Error(await errorText(response));
  for await (const event of events(response)) {
    if (event.error) throw new Error(event.error.message);
    if (event.usage) reply.usage = event.usage;
    if (event.timings) reply.timings = event.timings;
    for (const choice of event.choices || []) {
      const delta = choice.delta || {};
      reply.reasoning += delta.reasoning_content || "";
      reply.content += delta.content || "";
      if (delta.reasoning_content || delta.content) changed();
    }
  }
}

function timingNote(reply) {
  const t = reply.timings;
  if (!t) return "";
  const cached = reply.usage ? reply.usage.prompt_tokens_details.cached_tokens : t.cache_n;
  return `${t.predicted_n} tokens, ${t.predicted_per_second.toFixed(2)} tokens/s; ` +
         `prompt ${t.prompt_n} tokens (${cached} from the cache)`;
}
