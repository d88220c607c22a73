// Keep the report panel current while its report is unfinished: fetch the
// status fragment every 1.5 s and swap it in. No framework, no build step.
(function () {
  "use strict";
  var INTERVAL_MS = 1500;

  function panel() {
    return document.getElementById("report-panel");
  }

  function setUnread(value) {
    var badge = document.getElementById("unread-count");
    if (!badge || value === null) return;
    badge.textContent = value;
    badge.classList.toggle("count--zero", value === "0");
    badge.setAttribute("aria-label", value + " unread");
  }

  function stop(current, message) {
    current.dataset.finished = "true";
    var note = document.createElement("p");
    note.className = "report__gone";
    note.textContent = message;
    current.replaceChildren(note);
  }

  function schedule() {
    var current = panel();
    if (current && current.dataset.finished !== "true") {
      window.setTimeout(poll, INTERVAL_MS);
    }
  }

  function poll() {
    var current = panel();
    if (!current) return;
    fetch(current.dataset.pollUrl, {
      credentials: "same-origin",
      cache: "no-store",
      redirect: "manual",
      headers: { Accept: "text/html" },
    })
      .then(function (response) {
        if (response.status === 404) {
          stop(current, "This request is no longer available to you.");
          return null;
        }
        if (response.type === "opaqueredirect") {
          stop(current, "Your session ended. Reload the page to log in again.");
          return null;
        }
        if (!response.ok) return null; // a passing hiccup: try again next tick
        setUnread(response.headers.get("X-Unread-Notices"));
        return response.text();
      })
      .then(function (html) {
        if (!html) return;
        var template = document.createElement("template");
        template.innerHTML = html.trim();
        var fresh = template.content.firstElementChild;
        if (fresh && fresh.id === "report-panel") current.replaceWith(fresh);
      })
      .catch(function () {})
      .then(schedule);
  }

  schedule();
})();
