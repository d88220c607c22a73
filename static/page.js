// Focus for every page (no inline script: the CSP forbids it).
// 1. Move focus to what just happened: the error summary first, else the first banner
//    (GOV.UK error summary and notification banner patterns).
// 2. A link in the error summary focuses its field and scrolls the field's question
//    (legend or label) into view, not just the input.
(function () {
  "use strict";

  function focusOnLoad() {
    var target =
      document.querySelector(".error-summary[data-focus-on-load]") ||
      document.querySelector("[data-focus-on-load]");
    if (target) target.focus();
  }

  function questionOf(input) {
    var fieldset = input.closest("fieldset");
    if (fieldset) {
      var legend = fieldset.querySelector("legend");
      if (legend) return legend;
    }
    return (input.id && document.querySelector('label[for="' + input.id + '"]')) || input;
  }

  function onSummaryClick(event) {
    var link = event.target.closest(".error-summary a[href^='#']");
    if (!link) return;
    var input = document.getElementById(link.getAttribute("href").slice(1));
    if (!input) return;
    event.preventDefault();
    questionOf(input).scrollIntoView();
    input.focus({ preventScroll: true });
  }

  document.addEventListener("click", onSummaryClick);
  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", focusOnLoad);
  } else {
    focusOnLoad();
  }
})();
