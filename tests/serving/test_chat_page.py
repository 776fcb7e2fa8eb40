"""The chat page in a real browser: headless Chromium, driven by Selenium, against the server over a tiny random model.

A reply streams into its bubble (several lengths seen before the page marks it done) and equals the server's greedy
non-streamed reply to the same messages; Stop and New chat end a reply mid-stream, and the engine frees its slot.
The tiny model decodes a reply in milliseconds, so while the test watches a reply the engine is held: it runs its
next compiled call only once the page shows the text of the one before (or the request is cancelled). The polls
then see the reply grow, and it is still running when the test interrupts it, however fast or loaded the machine.
"""

import contextlib
import json
import shutil
import struct
import threading
import urllib.request

import pytest

from tests.conftest import skip_or_fail
from tests.live_server import serving, tiny_checkpoint

LONG = 180  # tokens of a reply to interrupt: many compiled calls (8 tokens each), of which the held engine runs one
SYSTEM = "You are a terse poet."
WAIT_S = 60  # bound on every wait for the page (the first request compiles the engine's programs)

# [length of the last reply's text, whether the page marked it done, the text], in one round trip.
LAST_REPLY = """
const replies = document.querySelectorAll("#log .msg.assistant");
const reply = replies[replies.length - 1];
return reply ? [reply.textContent.length, reply.dataset.done === "1", reply.textContent] : [0, false, ""];
"""


def _chromium():
  """A headless Chromium (window 1000×640) through chromedriver, or a skip naming what is missing."""
  try:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
  except ImportError:
    skip_or_fail("selenium is not installed (pip install selenium)")
  binary, driver = shutil.which("chromium") or shutil.which("chromium-browser"), shutil.which("chromedriver")
  if not binary or not driver:
    skip_or_fail("chromium and chromedriver are not installed (apt-get install chromium chromium-driver)")
  options = webdriver.ChromeOptions()
  options.binary_location = binary
  for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1000,640"):
    options.add_argument(flag)
  options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
  return webdriver.Chrome(options=options, service=Service(driver))


@pytest.fixture(scope="module")
def browser():
  driver = _chromium()
  try:
    yield driver
  finally:
    driver.quit()


class HeldEngine:
  """The server's engine, which the test can hold (`held`): after each compiled call that did work, the engine's
  thread then waits for the test's `next_call` (given once the page shows that call's text) or for a request to be
  cancelled (a client gone: the next call drops it). Outside `held`, it runs free."""

  def __init__(self, engine):
    self.engine = engine
    self._turn = threading.Condition()
    self._held, self._calls = False, 0
    step, cancel = engine.step, engine.cancel

    def held_step():  # the engine's thread calls self.step() each round
      busy = step()
      with self._turn:
        if busy and self._held:  # the bound only ends a hang (a test that never lets it go on)
          self._turn.wait_for(lambda: self._calls > 0 or not self._held, timeout=5 * WAIT_S)
          self._calls = max(self._calls - 1, 0)
      return busy

    def cancelled(request):  # the server's, when a client goes away
      cancel(request)
      self.next_call()

    engine.step, engine.cancel = held_step, cancelled

  def next_call(self) -> None:
    with self._turn:
      self._calls += 1
      self._turn.notify_all()

  @contextlib.contextmanager
  def held(self):
    with self._turn:
      self._held, self._calls = True, 0
    try:
      yield
    finally:
      with self._turn:
        self._held = False
        self._turn.notify_all()

  def __getattr__(self, name):  # the rest is the engine's (stats, busy_slots)
    return getattr(self.engine, name)


@pytest.fixture(scope="module")
def server(tmp_path_factory, small_tokenizer):
  """(url, engine) of the server over a random 2-layer model, its engine one the test can hold (HeldEngine)."""
  checkpoint_dir = tiny_checkpoint(str(tmp_path_factory.mktemp("checkpoint")), small_tokenizer)
  with serving(checkpoint_dir, slots=4, max_len=256) as (url, engine, _, _):
    yield url, HeldEngine(engine)


def _open_chat(driver, url: str, max_tokens: int) -> None:
  """Loads the page, waits for its status line, types the system prompt and sets temperature 0 (greedy: replies are
  known in advance) and max tokens."""
  from selenium.webdriver.common.by import By
  from selenium.webdriver.support.ui import WebDriverWait

  driver.get(url)
  WebDriverWait(driver, WAIT_S).until(lambda d: d.find_element(By.ID, "status").text == "tiny · 4 slots")
  driver.find_element(By.ID, "system").send_keys(SYSTEM)
  # A range input takes no keys: set it as a drag would, with the input event the page listens to.
  slider = driver.find_element(By.ID, "temperature")
  driver.execute_script("arguments[0].value = '0'; arguments[0].dispatchEvent(new Event('input'));", slider)
  assert driver.find_element(By.ID, "temperature_value").text == "0"
  _set_max_tokens(driver, max_tokens)


def _set_max_tokens(driver, max_tokens: int) -> None:
  from selenium.webdriver.common.by import By

  box = driver.find_element(By.ID, "max_tokens")
  box.clear()
  box.send_keys(str(max_tokens))


def _watch_reply(driver, engine: HeldEngine) -> tuple[list[int], str]:
  """The lengths of the last reply's text seen while it streamed, and its final text. Each new length seen lets the
  held engine run its next call: the page shows every call's text before the next one runs."""
  from selenium.webdriver.support.ui import WebDriverWait

  seen = []

  def done(d):
    length, finished, text = d.execute_script(LAST_REPLY)
    if finished:
      return text
    if length != (seen[-1] if seen else 0):
      seen.append(length)
      engine.next_call()
    return False

  return seen, WebDriverWait(driver, WAIT_S, poll_frequency=0.02).until(done)


def _interrupt_when_text_shows(driver, engine: HeldEngine, button: str) -> int:
  """Clicks `button` once the last reply has text (the engine held: the reply cannot end meanwhile); returns the
  reply's length when the page marked it done (0 when the bubble is gone). Then the engine must free the slot by
  cancelling the request (one that ran to its end would count as "length"), and the page must take a new message."""
  from selenium.webdriver.common.by import By
  from selenium.webdriver.support.ui import WebDriverWait

  cancelled, finished = engine.stats["finished_cancelled"], engine.stats["finished_length"]
  WebDriverWait(driver, WAIT_S, poll_frequency=0.02).until(lambda d: d.execute_script(LAST_REPLY)[0] > 0)
  driver.find_element(By.ID, button).click()
  # The page re-enables Send in the same task that marks the reply done: from here on its text is final.
  WebDriverWait(driver, WAIT_S).until(lambda d: d.find_element(By.ID, "send").is_enabled())
  length = driver.execute_script(LAST_REPLY)[0]
  assert not driver.find_element(By.ID, "stop").is_enabled()
  # The closed stream cancels the request: its slot is freed before the engine's next call.
  WebDriverWait(driver, WAIT_S, poll_frequency=0.05).until(lambda _: engine.busy_slots() == 0)
  assert (engine.stats["finished_cancelled"], engine.stats["finished_length"]) == (cancelled + 1, finished)
  return length


def _greedy(url: str, message: str, max_tokens: int) -> str:
  """The server's non-streamed reply at temperature 0 to the system prompt and `message` (what the page sends)."""
  messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": message}]
  body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
  request = urllib.request.Request(
    url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
  )
  with urllib.request.urlopen(request, timeout=WAIT_S) as response:
    choice = json.load(response)["choices"][0]
  assert choice["finish_reason"] == "length"  # no early eos: the reply is max_tokens long
  return choice["message"]["content"]


def _page_errors(driver) -> list[str]:
  """Severe console messages (script errors, failed requests) but the favicon's 404: the page declares none."""
  return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE" and "favicon" not in e["message"]]


def test_reply_streams_into_the_page_and_equals_the_greedy_reply(browser, server, tmp_path):
  from selenium.webdriver.common.by import By

  url, engine = server
  message, max_tokens = "Write about the sea.", 40
  _open_chat(browser, url, max_tokens)
  browser.find_element(By.ID, "input").send_keys(message)
  with engine.held():
    browser.find_element(By.ID, "send").click()
    assert browser.find_element(By.ID, "send").get_attribute("disabled")  # one reply at a time
    lengths, text = _watch_reply(browser, engine)

  growing = sorted({n for n in lengths if n > 0})
  assert len(growing) >= 2, f"no growth while streaming: lengths {sorted(set(lengths))} in {len(lengths)} polls"
  assert [b.text for b in browser.find_elements(By.CSS_SELECTOR, "#log .msg.user")] == [message]
  assert not browser.find_elements(By.CSS_SELECTOR, "#log .msg.error")
  assert browser.find_element(By.ID, "send").is_enabled() and not browser.find_element(By.ID, "stop").is_enabled()
  assert text == _greedy(url, message, max_tokens)
  assert not _page_errors(browser)

  shot = tmp_path / "chat.png"
  assert browser.save_screenshot(str(shot))
  png = shot.read_bytes()
  width, height = struct.unpack(">II", png[16:24])  # the IHDR chunk follows the 8-byte signature
  assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000 and width >= 800 and height >= 400


def test_stop_ends_the_reply_and_frees_the_slot(browser, server):
  from selenium.webdriver.common.by import By
  from selenium.webdriver.common.keys import Keys

  url, engine = server
  _open_chat(browser, url, LONG)
  with engine.held():
    browser.find_element(By.ID, "input").send_keys("Tell me a long story.", Keys.ENTER)
    stopped_at = _interrupt_when_text_shows(browser, engine, "stop")
  # The slot is free: no token of this request is left to come. The text stopped where the page marked it done.
  length, done, _ = browser.execute_script(LAST_REPLY)
  assert done and length == stopped_at > 0
  assert not browser.find_elements(By.CSS_SELECTOR, "#log .msg.error")
  assert not _page_errors(browser)


def test_new_chat_during_a_reply_cancels_it_and_starts_clean(browser, server):
  from selenium.webdriver.common.by import By
  from selenium.webdriver.common.keys import Keys

  url, engine = server
  _open_chat(browser, url, LONG)
  with engine.held():
    browser.find_element(By.ID, "input").send_keys("Tell me a long story.", Keys.ENTER)
    _interrupt_when_text_shows(browser, engine, "clear")
  assert not browser.find_elements(By.CSS_SELECTOR, "#log .msg")

  # The next message opens the new chat: the interrupted exchange is not in its history, so the reply is the greedy
  # reply to the system prompt and this message alone.
  message, max_tokens = "Hello.", 8
  _set_max_tokens(browser, max_tokens)
  with engine.held():
    browser.find_element(By.ID, "input").send_keys(message, Keys.ENTER)
    _, text = _watch_reply(browser, engine)
  assert text == _greedy(url, message, max_tokens)
  assert not _page_errors(browser)
