// Replies as markdown, rendered safely, and copying text to the clipboard.
//
// The renderer is markdown-it (markdown-it.min.js, vendored unmodified with its MIT notice) in its
// safe configuration. `html: false` means a reply's HTML is never parsed as HTML: `<script>` or
// `<img onerror=...>` in a reply come out escaped, as the text they are. Its link check refuses
// javascript:, vbscript:, file: and data: URLs (data: images of PNG, GIF, JPEG and WebP excepted),
// so such a link is shown as text. The page's Content-Security-Policy (index.html) is the second
// wall: no inline script or event handler runs, and no image is loaded from another origin.
"use strict";

const markdown = window.markdownit({ html: false, linkify: false, typographer: false, breaks: true });

// A reply's links open in another tab, and the page they open gets no handle on this one.
const renderLinkOpen = markdown.renderer.rules.link_open ||
  ((tokens, i, options, env, self) => self.renderToken(tokens, i, options));
markdown.renderer.rules.link_open = (tokens, i, options, env, self) => {
  tokens[i].attrSet("target", "_blank");
  tokens[i].attrSet("rel", "noopener noreferrer");
  return renderLinkOpen(tokens, i, options, env, self);
};

// A table column's alignment as a class (chat.css): the page's policy applies no style attribute.
for (const rule of ["th_open", "td_open"]) {
  markdown.renderer.rules[rule] = (tokens, i, options, env, self) => {
    const style = tokens[i].attrGet("style");  // markdown-it writes "text-align:left|center|right"
    if (style) {
      tokens[i].attrs = tokens[i].attrs.filter(([name]) => name !== "style");
      tokens[i].attrJoin("class", "align-" + style.replace("text-align:", ""));
    }
    return self.renderToken(tokens, i, options);
  };
}

// Render markdown text into element (its old content replaced); each code block gets a Copy button.
// The chat page renders every reply through this function, and the tests call it too.
function renderMarkdown(element, text) {
  element.innerHTML = markdown.render(text);
  for (const pre of element.querySelectorAll("pre")) {
    const code = pre.textContent;
    pre.prepend(copyButton(() => code, "copy-code"));
  }
}

// A button that copies what `text()` returns at the time of the click, and says so.
function copyButton(text, className) {
  const button = document.createElement("button");
  button.type = "button";
  button.className = className;
  button.textContent = "Copy";
  button.addEventListener("click", async () => {
    try {
      await copyText(text());
      button.textContent = "Copied";
    } catch (_) {
      button.textContent = "Copy failed";
    }
    setTimeout(() => { button.textContent = "Copy"; }, 1500);
  });
  return button;
}

async function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) {
    await navigator.clipboard.writeText(text);
    return;
  }
  // The clipboard API is offered only to secure pages (https, or this machine): over plain http
  // from another machine, a selected hidden textarea and the old copy command do it.
  const area = document.createElement("textarea");
  area.value = text;
  area.className = "offscreen";
  document.body.appendChild(area);
  area.select();
  const done = document.execCommand("copy");
  area.remove();
  if (!done) throw new Error("the browser refused to copy");
}
