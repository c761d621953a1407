// kvserve's chat page: each turn POSTs the whole conversation to /v1/chat/completions with
// stream: true and reads the server-sent events as they arrive. Model text only ever goes into
// the page as textContent. The model name comes from GET /v1/models; the API key, when set,
// is kept in localStorage and sent as "Authorization: Bearer KEY".
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "kvserve.apiKey";
// history: the user/assistant turns; session: bumped by "New chat", so an answer it cut off
// leaves the new conversation alone
const chat = { model: null, history: [], controller: null, session: 0 };

class ServerError extends Error {}

function showAlert(text) {
  $("alert").textContent = text;
  $("alert").hidden = false;
}

function clearAlert() {
  $("alert").hidden = true;
  $("alert").textContent = "";
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

// What a refused request says: the server's {"error": {"message"}} and, for a 401, what to do.
async function refusal(resp) {
  let message = "";
  try {
    message = (await resp.json()).error.message || "";
  } catch (e) { /* not OpenAI's error shape */ }
  if (resp.status === 401) {
    return "401 Unauthorized: this server needs an API key. Enter it under Settings → API key " +
           "(it is kept in this browser)." + (message ? " The server said: " + message : "");
  }
  return `The server answered ${resp.status}` + (message ? ": " + message : "");
}

async function loadModel() {
  chat.model = null;
  $("model").textContent = "…";
  try {
    const resp = await fetch("/v1/models", { headers: headers() });
    if (!resp.ok) throw new ServerError(await refusal(resp));
    chat.model = (await resp.json()).data[0].id;
    $("model").textContent = chat.model;
    clearAlert();
  } catch (e) {
    $("model").textContent = "no model";
    showAlert(e instanceof ServerError ? e.message : "Cannot reach the server: " + e.message);
  }
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "message " + role;
  for (const [cls, value] of [["role", role], ["content", text], ["stats", ""]]) {
    const part = document.createElement("div");
    part.className = cls;
    part.textContent = value;
    div.append(part);
  }
  $("messages").append(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

// Server-sent events: blocks end with a blank line; a block's "data:" lines hold one JSON
// chunk, and "data: [DONE]" ends the stream.
async function* sseChunks(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = /\r?\n\r?\n/.exec(buffer)) !== null) {
      const block = buffer.slice(0, end.index);
      buffer = buffer.slice(end.index + end[0].length);
      const data = block.split(/\r?\n/).filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
      if (data === "[DONE]") return;
      if (data) yield JSON.parse(data);
    }
  }
}

function requestBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...chat.history);
  const body = { model: chat.model, messages, stream: true, stream_options: { include_usage: true } };
  const temperature = parseFloat($("temperature").value);
  if (Number.isFinite(temperature)) body.temperature = temperature;
  const maxTokens = parseInt($("max-tokens").value, 10);
  if (Number.isFinite(maxTokens)) body.max_tokens = maxTokens;
  return body;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

// One turn: stream the answer into a new message; keep it in the history unless nothing came.
async function send(text) {
  if (chat.controller) return;
  if (!chat.model) await loadModel();
  if (!chat.model) {                        // refused (the alert says why): the text is kept
    if (!$("input").value) $("input").value = text;
    return;
  }
  clearAlert();
  const session = chat.session;
  chat.history.push({ role: "user", content: text });
  const userDiv = addMessage("user", text);
  const answerDiv = addMessage("assistant", "");
  const content = answerDiv.querySelector(".content");
  answerDiv.classList.add("streaming");
  const controller = new AbortController();
  chat.controller = controller;
  setBusy(true);
  const start = performance.now();
  let answer = "", first = null, last = null, usage = null, finish = null, outcome = "done";
  try {
    const resp = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(requestBody()),
      signal: controller.signal,
    });
    if (!resp.ok) throw new ServerError(await refusal(resp));
    for await (const chunk of sseChunks(resp.body)) {
      if (chunk.error) throw new ServerError("The server ended the answer: " + chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const delta = choice.delta && choice.delta.content;
        if (delta) {
          last = performance.now();
          if (first === null) first = last;
          answer += delta;
          content.textContent = answer;
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
    }
  } catch (e) {
    if (e.name === "AbortError") outcome = "stopped";
    else {
      outcome = "error";
      showAlert(e instanceof ServerError ? e.message : "The request failed: " + e.message);
    }
  } finally {
    chat.controller = null;
    setBusy(false);
    answerDiv.classList.remove("streaming");
  }
  if (session !== chat.session) return;
  if (!answer && outcome !== "done") {     // nothing to keep: the turn is undone, its text back
    chat.history.pop();
    userDiv.remove();
    answerDiv.remove();
    if (!$("input").value) $("input").value = text;
    if (outcome === "stopped") showAlert("Stopped before the first token.");
    return;
  }
  chat.history.push({ role: "assistant", content: answer });
  answerDiv.querySelector(".stats").textContent = stats(start, first, last, usage, finish, outcome);
}

// "TTFT 41 ms · 312.4 tok/s · 128 tokens · finish length": tok/s is the completion tokens over
// the time from sending to the last token (from the usage chunk; a stopped answer has none).
function stats(start, first, last, usage, finish, outcome) {
  const parts = [];
  if (first !== null) parts.push(`TTFT ${Math.round(first - start)} ms`);
  if (usage && last !== null) {
    const tokens = usage.completion_tokens;
    parts.push(`${(tokens / Math.max((last - start) / 1000, 1e-3)).toFixed(1)} tok/s`);
    parts.push(`${tokens} tokens`);
  }
  if (outcome === "stopped") parts.push("stopped");
  else if (outcome === "error") parts.push("ended by an error");
  else if (finish) parts.push(`finish ${finish}`);
  return parts.join(" · ");
}

function newChat() {
  if (chat.controller) chat.controller.abort();
  chat.session += 1;
  chat.history = [];
  $("messages").replaceChildren();
  clearAlert();
  $("input").focus();
}

function submit(event) {
  event.preventDefault();
  const text = $("input").value.trim();
  if (!text || chat.controller) return;
  $("input").value = "";
  send(text);
}

document.addEventListener("DOMContentLoaded", () => {
  $("api-key").value = localStorage.getItem(KEY_STORE) || "";
  $("api-key").addEventListener("change", () => {
    const key = $("api-key").value.trim();
    if (key) localStorage.setItem(KEY_STORE, key);
    else localStorage.removeItem(KEY_STORE);
    loadModel();
  });
  $("composer").addEventListener("submit", submit);
  $("input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) submit(event);
  });
  $("stop").addEventListener("click", () => chat.controller && chat.controller.abort());
  $("new-chat").addEventListener("click", newChat);
  loadModel();
});
