// An open page of an unfinished job keeps its progress current: poll the job's follow URL
// every second (view permission asked there), write the progress into its field and the
// state's word into the line, and reload once the job finished so every field is current.
// No inline script (CSP); without JavaScript the line says to reload.
document.addEventListener("DOMContentLoaded", function () {
  "use strict";
  var line = document.getElementById("jobs-live");
  if (!line) return;
  var url = line.dataset.liveUrl;
  var progress = document.querySelector(".field-progress .readonly");
  function tick() {
    fetch(url, { credentials: "same-origin", cache: "no-store" })
      .then(function (r) { return r.ok ? r.json() : null; })
      .then(function (data) {
        if (!data) return window.setTimeout(tick, 5000);
        if (progress && data.progress !== undefined && progress.textContent !== data.progress) {
          progress.textContent = data.progress;
          progress.dataset.live = "1";
        }
        if (data.settled) {
          // Finished: the whole page, once, shows where it ended (its steps, its result).
          window.location.replace(window.location.pathname);
          return;
        }
        var said = data.state_word + ": " + data.progress + " (updates every second).";
        if (line.textContent !== said) line.textContent = said;  // no repeat for screen readers
        window.setTimeout(tick, 1000);
      })
      .catch(function () { window.setTimeout(tick, 5000); });
  }
  window.setTimeout(tick, 1000);
});
