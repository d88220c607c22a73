// After an operator action the change page follows the object until it settles: poll its
// state every 1.5 s, say it in the status line, and reload once it settled so every field
// on the page is current. No inline script (CSP); without JavaScript the page says how to
// see the outcome (reload).
// Loaded in the head by the admin's media: start once the page is parsed.
document.addEventListener("DOMContentLoaded", function () {
  "use strict";
  var line = document.getElementById("jobs-follow");
  if (!line) return;
  var url = line.dataset.followUrl;
  var shown = line.dataset.state; // the state the page's fields show
  function tick() {
    fetch(url, { credentials: "same-origin", cache: "no-store" })
      .then(function (r) { return r.ok ? r.json() : null; })
      .then(function (data) {
        if (!data) return window.setTimeout(tick, 3000);
        if (data.text !== line.textContent) line.textContent = data.text;
        if (data.settled) {
          if (data.state !== shown) {
            // Settled in another state than the page shows: reload it, keeping the message.
            window.location.replace(window.location.pathname + "?followed=1");
          }
          return;
        }
        window.setTimeout(tick, 1500);
      })
      .catch(function () { window.setTimeout(tick, 3000); });
  }
  tick();
});
