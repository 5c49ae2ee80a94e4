// kvfleet console: refresh each page's live section, and ask before a destructive button.
// Plain script, no build step; the server renders every byte of HTML.
(function () {
  const live = document.getElementById("live");
  if (live && live.dataset.refresh) {
    const every = Number(live.dataset.refresh) * 1000;
    const refresh = async function () {
      if (!document.hidden) {
        try {
          const response = await fetch(window.location.href,
            {headers: {"X-Console-Fragment": "1"}, credentials: "same-origin"});
          if (response.ok) {
            live.innerHTML = await response.text();
            live.dataset.refreshedAt = String(Date.now());
          }
        } catch (error) {
          // the API is away for a moment: the next round tries again
        }
      }
      window.setTimeout(refresh, every);
    };
    window.setTimeout(refresh, every);
  }
  document.addEventListener("submit", function (event) {
    const message = event.target.dataset.confirm;
    if (message && !window.confirm(message)) {
      event.preventDefault();
    }
  });
})();
