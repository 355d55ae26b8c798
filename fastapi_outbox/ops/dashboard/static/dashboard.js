// fastapi-outbox dashboard: refresh the overview, run actions. No framework, no build step.
// Server-rendered fragments are escaped by the server; messages from actions are shown
// with textContent only.
"use strict";
(function () {
  const csrf = document.querySelector('meta[name="outbox-csrf"]').content;
  // Where the server found this dashboard (its mount, proxy root_path and prefix included):
  // every action goes to this outbox's own API, never to a fixed path.
  const base = document.querySelector('meta[name="outbox-base"]').content;

  function flash(text, bad) {
    const box = document.getElementById("flash");
    box.textContent = text;
    box.classList.toggle("bad", !!bad);
    box.hidden = false;
  }

  const carried = sessionStorage.getItem("outbox-flash");
  if (carried) {
    sessionStorage.removeItem("outbox-flash");
    const data = JSON.parse(carried);
    flash(data.text, data.bad);
  }

  // Overview: swap in a fresh fragment every few seconds, without reloading the page.
  const overview = document.getElementById("overview");
  if (overview) {
    const url = overview.dataset.refreshUrl;
    const every = Number(overview.dataset.refreshSeconds || 5) * 1000;
    setInterval(async function () {
      try {
        const response = await fetch(url, { headers: { Accept: "text/html" }, credentials: "same-origin" });
        if (response.ok) overview.innerHTML = await response.text();
      } catch (e) { /* keep the last view; the next tick tries again */ }
    }, every);
  }

  document.addEventListener("change", function (event) {
    if (event.target.matches("[data-select-all]")) {
      document.querySelectorAll('#messages input[name="id"]').forEach(function (box) {
        box.checked = event.target.checked;
      });
    }
  });

  function post(action, body) {
    return fetch(base + "/api/" + action, {
      method: "POST",
      credentials: "same-origin",
      headers: { "Content-Type": "application/json", "X-Outbox-CSRF": csrf },
      body: JSON.stringify(body),
    });
  }

  function detail(data) {
    return typeof data.detail === "string" ? data.detail : JSON.stringify(data.detail);
  }

  document.addEventListener("click", async function (event) {
    const button = event.target.closest("button[data-action]");
    if (!button) return;
    const body = {};
    if (button.dataset.action === "replay-dead-letters") {
      body.stream = button.dataset.stream;
      body.group = button.dataset.group;
    } else if (button.dataset.allAbandoned) {
      body.all_abandoned = true;
      body.stream = button.dataset.stream || null;
      body.count = Number(button.dataset.count);  // never more than the count confirmed
    } else if (button.dataset.selection) {
      body.ids = Array.from(document.querySelectorAll('#messages input[name="id"]:checked')).map(function (b) { return b.value; });
      if (!body.ids.length) { flash("Select messages first.", true); return; }
    } else {
      body.ids = button.dataset.ids.split(",");
    }
    const question = (button.dataset.confirm || "Are you sure?") + (body.ids ? " (" + body.ids.length + " selected)" : "");
    if (!window.confirm(question)) return;
    button.disabled = true;
    try {
      let response = await post(button.dataset.action, body);
      let data = await response.json();
      if (response.status === 409 && button.dataset.action === "replay-dead-letters") {
        // Dead letters older than the inbox retention: say so, and force only when asked to.
        if (!window.confirm("Warning: " + detail(data) + "\n\nReplay them anyway?")) {
          flash("Not replayed: " + detail(data), true);
          return;
        }
        body.force = true;
        response = await post(button.dataset.action, body);
        data = await response.json();
      }
      if (!response.ok) {
        flash("Refused: " + detail(data), true);
        return;
      }
      const verb = { "replay": "Replayed", "abandon": "Abandoned", "replay-dead-letters": "Put back on the stream" }[button.dataset.action];
      let text = verb + " " + data.changed + (button.dataset.action === "replay-dead-letters" ? " dead letter(s)." : " message(s).");
      if (data.problems && data.problems.length) text += " Not changed: " + data.problems.join("; ");
      sessionStorage.setItem("outbox-flash", JSON.stringify({ text: text, bad: data.problems && data.problems.length > 0 }));
      window.location.reload();
    } catch (e) {
      flash("The action failed: " + e, true);
    } finally {
      button.disabled = false;
    }
  });
})();
