"""The console in a real browser (headless chromium): log in, watch a batch's progress
advance to completed, open its page, cancel a second batch from its button, and see that a
custom_id holding <script> renders as text. Screenshots go to out/console/."""

from __future__ import annotations

import time

from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.ui import WebDriverWait

from jobs import batches, keys
from jobs.recording import record_result
from jobs.results import error_line
from jobs.storage import RedisStorage
from tests.console.conftest import API_KEY, SCREENSHOTS
from tests.workers.helpers import completion, submit_lines

XSS = '<script>window.__pwned = 1</script>'


def log_in(browser, base: str) -> None:
    browser.get(f"{base}/ui")
    assert browser.current_url.endswith("/ui/login")  # the same key as the API guards the console
    browser.find_element(By.NAME, "key").send_keys(API_KEY)
    browser.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
    WebDriverWait(browser, 10).until(lambda b: b.current_url.endswith("/ui"))


def text_of(browser, selector: str) -> str:
    """An element's text in one step: the live section may be replaced between two WebDriver calls."""
    return browser.execute_script("const e = document.querySelector(arguments[0]); return e ? e.innerText : '';",
                                  selector)


def row_text(browser, batch_id: str) -> str:
    return text_of(browser, f'tr[data-batch="{batch_id}"]')


def test_watch_a_batch_finish_cancel_another_and_user_input_stays_text(console_api, console_worker, browser, r):
    base = console_api.url
    slow = [completion(f"c{i}", f"document {i} " + "and then " * 10, 64, ignore_eos=True) for i in range(48)]
    watched = submit_lines(r, slow, metadata={"description": "nightly <b>summaries</b>"})
    # Served by no worker: stays in progress until cancelled from its page.
    doomed = submit_lines(r, [completion("d0", "x")], model="nobody-serves-this")
    log_in(browser, base)

    seen, deadline = [], time.monotonic() + 120
    while "completed" not in row_text(browser, watched):  # the page refreshes itself, no reload
        counts = text_of(browser, f'tr[data-batch="{watched}"] .counts')
        if not seen or seen[-1] != counts:
            seen.append(counts)
        if len(seen) == 2:
            browser.save_screenshot(str(SCREENSHOTS / "batches-running.png"))
        assert time.monotonic() < deadline, seen
        time.sleep(0.2)
    assert len(seen) >= 3, f"progress never advanced on the page: {seen}"  # e.g. 0/48, 12/48, 30/48
    assert row_text(browser, watched).count("48 / 48") == 1
    assert "nightly <b>summaries</b>" in row_text(browser, watched)  # metadata shows as text
    browser.save_screenshot(str(SCREENSHOTS / "batches.png"))

    browser.find_element(By.LINK_TEXT, watched).click()
    WebDriverWait(browser, 10).until(lambda b: text_of(b, "#status") == "completed")
    assert browser.find_elements(By.LINK_TEXT, f"{watched}_output.jsonl")
    assert not browser.find_elements(By.ID, "cancel")  # nothing to cancel any more
    browser.find_element(By.NAME, "custom_id").send_keys("c7")
    browser.find_element(By.CSS_SELECTOR, "form[method=get] input[type=submit]").click()
    WebDriverWait(browser, 10).until(lambda b: '"custom_id": "c7"' in text_of(b, "#result"))
    browser.save_screenshot(str(SCREENSHOTS / "batch.png"))

    browser.get(f"{base}/ui/batches/{doomed}")
    WebDriverWait(browser, 10).until(lambda b: b.find_elements(By.ID, "cancel"))
    browser.find_element(By.ID, "cancel").click()
    WebDriverWait(browser, 5).until(expected_conditions.alert_is_present())
    alert = browser.switch_to.alert
    assert doomed in alert.text
    alert.accept()
    WebDriverWait(browser, 10).until(lambda b: text_of(b, "#status") in ("cancelling", "cancelled"))
    assert batches.batch_object(r, doomed)["status"] in ("cancelling", "cancelled")

    hostile = submit_lines(r, [completion(XSS, "x")], model="nobody-serves-this")
    record_result(r, RedisStorage(r), hostile, error_line(XSS, "invalid_request", f"bad {XSS}"),
                  partition=0)
    browser.get(f"{base}/ui/batches/{hostile}")
    errors = text_of(browser, "#errors")
    assert XSS in errors and f"bad {XSS}" in errors  # shown as the characters the user sent
    assert browser.execute_script("return window.__pwned") is None  # and never run
    assert not browser.find_elements(By.XPATH, "//main//script")
    browser.save_screenshot(str(SCREENSHOTS / "batch-errors.png"))

    browser.get(f"{base}/ui/workers")
    row = text_of(browser, "#workers tbody tr")
    assert row.startswith("console-worker") and "serving" in row
    browser.save_screenshot(str(SCREENSHOTS / "workers.png"))
    r.xadd(keys.dead_letters(keys.batch_stream("tiny", watched)), {"batch_id": watched, "custom_id": XSS, "stream": "s",
                                                    "error": "delivered 4 times (max_deliveries 3)"})
    browser.get(f"{base}/ui/dead-letters")
    assert "delivered 4 times" in text_of(browser, "#dead-letters")
    assert browser.execute_script("return window.__pwned") is None
    browser.save_screenshot(str(SCREENSHOTS / "dead-letters.png"))
    browser.set_window_size(390, 844)  # a phone: the page fits its width, wide tables scroll in place
    browser.get(f"{base}/ui")
    assert browser.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
    browser.save_screenshot(str(SCREENSHOTS / "batches-phone.png"))
    assert {"batches-phone.png", "batches-running.png", "batches.png", "batch.png", "batch-errors.png", "workers.png",
            "dead-letters.png"} <= {path.name for path in SCREENSHOTS.glob("*.png")}
