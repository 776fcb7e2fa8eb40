"""The README's picture of the chat page: a checkpoint served by ``python -m llama_jax.serve`` on 127.0.0.1, a
conversation typed into the page by headless Chromium (selenium), greedy, and a screenshot once the last reply is done.

    python docs/chat_screenshot.py --checkpoint runs/smollm2-135m-instruct --out docs/images/serve_chat.png

docs/images/serve_chat.png is SmolLM2-135M-Instruct converted from HF (docs/guides/serving.md), with the system
prompt and turns below. Needs chromium and chromedriver (apt-get install chromium chromium-driver)
and selenium (the test extra).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

import httpx
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

SYSTEM = "You are a helpful assistant. Answer briefly."
TURNS = ("What is the capital of France?", "What is it famous for?", "Write a haiku about the sea.")
LAST_DONE = """
const replies = document.querySelectorAll("#log .msg.assistant");
return replies.length > 0 && replies[replies.length - 1].dataset.done === "1";
"""


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--checkpoint", required=True)
  parser.add_argument("--out", default="docs/images/serve_chat.png")
  parser.add_argument("--model_name", default="smollm2-135m-instruct")
  parser.add_argument("--max_tokens", type=int, default=80)
  args = parser.parse_args()
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  server = subprocess.Popen(
    [
      sys.executable,
      "-m",
      "llama_jax.serve",
      "--checkpoint",
      args.checkpoint,
      "--port",
      str(port),
      "--slots",
      "2",
      "--max_len",
      "512",
      "--model_name",
      args.model_name,
    ],
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  url = f"http://127.0.0.1:{port}"
  try:
    deadline = time.monotonic() + 600
    while True:
      try:
        if httpx.get(f"{url}/health", timeout=2).status_code == 200:
          break
      except httpx.HTTPError:
        pass
      if server.poll() is not None or time.monotonic() > deadline:
        raise SystemExit(f"the server did not start (exit status {server.poll()})")
      time.sleep(0.5)
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1000,760"):
      options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service("/usr/bin/chromedriver"))
    try:
      driver.get(url)
      WebDriverWait(driver, 60).until(lambda d: d.find_element(By.ID, "status").text.startswith(args.model_name))
      driver.find_element(By.ID, "system").send_keys(SYSTEM)
      slider = driver.find_element(By.ID, "temperature")
      driver.execute_script("arguments[0].value = '0'; arguments[0].dispatchEvent(new Event('input'));", slider)
      box = driver.find_element(By.ID, "max_tokens")
      box.clear()
      box.send_keys(str(args.max_tokens))
      for turn in TURNS:
        driver.find_element(By.ID, "input").send_keys(turn)
        driver.find_element(By.ID, "send").click()
        WebDriverWait(driver, 120, poll_frequency=0.1).until(
          lambda d: d.execute_script(LAST_DONE) and d.find_element(By.ID, "send").is_enabled()
        )
      driver.save_screenshot(args.out)
    finally:
      driver.quit()
  finally:
    server.terminate()
    server.wait(30)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
