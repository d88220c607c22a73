// Keep the report panel current while anything in it is still changing (the report,
// or a notice on its way): fetch the status fragment every 1.5 s and copy what changed
// into the parts marked data-live. The panel, its live region and every part stay the
// same elements, so screen readers announce the new status text and focus stays put.
// Without JavaScript the panel shows a "Check again" link instead (no auto-refresh that
// would wipe a half-typed decision). No framework, no build step, no inline script.
(function () {
  "use strict";
  var INTERVAL_MS = 1500;

  function panel() {
    return document.getElementById("report-panel");
  }

  function parts(root) {
    var found = {};
    root.querySelectorAll("[data-live]").forEach(function (el) {
      found[el.dataset.live] = el;
    });
    return found;
  }

  function setUnread(value) {
    var badge = document.getElementById("unread-count");
    if (!badge || value === null || badge.textContent === value) return;
    badge.textContent = value;
    badge.classList.toggle("count--zero", value === "0");
  }

  function copyAttributes(from, to) {
    Array.prototype.forEach.call(from.attributes, function (attr) {
      if (to.getAttribute(attr.name) !== attr.value) to.setAttribute(attr.name, attr.value);
    });
  }

  // Replace a part's content, then give focus back to the same control if it was inside.
  function update(current, fresh) {
    copyAttributes(fresh, current);
    current.hidden = fresh.hidden;
    if (current.innerHTML === fresh.innerHTML) return;
    if (current.getAttribute("role") === "status") {
      current.textContent = fresh.textContent; // text only: the region itself never changes
      return;
    }
    var active = document.activeElement;
    var focusedId = active && current.contains(active) ? active.id : "";
    current.replaceChildren.apply(current, Array.prototype.slice.call(fresh.childNodes));
    if (focusedId) {
      var again = document.getElementById(focusedId);
      if (again) again.focus();
    }
  }

  // The decision opens once the current revision's report is ready (the server refuses
  // an early one too): enable the form in place, keeping whatever was typed.
  function gate(ready, why) {
    var fields = document.getElementById("decision-gate");
    var wait = document.getElementById("decision-wait");
    if (fields) fields.disabled = !ready;
    if (wait) {
      wait.hidden = ready;
      if (why && wait.textContent !== why) wait.textContent = why;
    }
  }

  function apply(current, fresh) {
    current.dataset.finished = fresh.dataset.finished;
    current.dataset.ready = fresh.dataset.ready;
    gate(fresh.dataset.ready === "true", fresh.dataset.decisionWait);
    var now = parts(current);
    var next = parts(fresh);
    Object.keys(now).forEach(function (key) {
      if (key === "check-again") return; // JavaScript polls: the link is not needed
      if (next[key]) update(now[key], next[key]);
      else now[key].hidden = true;
    });
  }

  function stop(current, message) {
    current.dataset.finished = "true";
    var status = document.getElementById("report-status");
    if (status) status.textContent = message;
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
        if (fresh && fresh.id === "report-panel") apply(current, fresh);
      })
      .catch(function () {})
      .then(schedule);
  }

  var start = panel();
  if (start) {
    var link = start.querySelector('[data-live="check-again"]');
    if (link) link.hidden = true;
  }
  schedule();
})();
