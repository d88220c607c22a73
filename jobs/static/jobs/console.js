// The operations console refreshes its figures every few seconds, with a pause.
// It fetches the live part of the page (?part=live) and swaps it in; the page, its
// buttons and focus stay put. Without JavaScript, "Refresh now" reloads the page.
(function () {
  "use strict";
  var live = document.getElementById("console-live");
  var pause = document.getElementById("console-pause");
  if (!live || !pause) return;
  var interval = parseInt(live.dataset.intervalMs, 10) || 5000;
  var timer = null;

  function paused() {
    return pause.getAttribute("aria-pressed") === "true";
  }

  function schedule() {
    window.clearTimeout(timer);
    if (!paused()) timer = window.setTimeout(refresh, interval);
  }

  function refresh() {
    fetch(live.dataset.pollUrl, { credentials: "same-origin", cache: "no-store", redirect: "manual" })
      .then(function (response) {
        return response.ok ? response.text() : null;
      })
      .then(function (html) {
        if (html === null || paused()) return;
        // Keep focus on a link inside the live part if it is still there after the swap.
        var active = document.activeElement;
        var href = active && live.contains(active) ? active.getAttribute("href") : null;
        live.innerHTML = html;
        if (href) {
          var again = live.querySelector('a[href="' + CSS.escape(href) + '"]');
          if (again) again.focus();
        }
      })
      .catch(function () {})
      .then(schedule);
  }

  pause.hidden = false;
  pause.addEventListener("click", function () {
    var nowPaused = !paused();
    pause.setAttribute("aria-pressed", nowPaused ? "true" : "false");
    pause.textContent = nowPaused ? "Resume updates" : "Pause updates";
    if (nowPaused) window.clearTimeout(timer);
    else refresh();
  });
  schedule();
})();
