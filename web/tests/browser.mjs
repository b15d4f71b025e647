// Drives the demo page in Debian's Chromium (playwright-core) the way a person would, and prints
// what the page showed as one JSON object. Used by tests/test_browser.py.
//
//   node web/tests/browser.mjs '{"url": "http://127.0.0.1:7860/", "scenario": "conversation", ...}'
//
// Scenarios:
//   conversation  fake microphone plays `wav` once; wait for `userTurns` user turns and an agent
//                 reply after the last one (or `timeoutMs`); a level trace is returned
//   mic-denied    the microphone permission is refused
//   server-down   /api/session cannot be reached
import { chromium } from "playwright-core";

const options = JSON.parse(process.argv[2]);
const {
  url, scenario, wav, screenshot, apiKey, userTurns = 2, timeoutMs = 90000,
  viewport = { width: 390, height: 844 }, chromiumPath = "/usr/bin/chromium",
} = options;

const args = [
  "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
  "--disable-background-networking", "--disable-component-update", "--disable-sync",
  "--autoplay-policy=no-user-gesture-required",
];
args.push("--use-fake-device-for-media-stream");
if (scenario === "mic-denied") {
  args.push("--deny-permission-prompts"); // the person clicks "Block"
} else {
  args.push("--use-fake-ui-for-media-stream"); // the person clicks "Allow"
  if (wav) args.push(`--use-file-for-fake-audio-capture=${wav}%noloop`);
}

const browser = await chromium.launch({ executablePath: chromiumPath, headless: true, args });
const context = await browser.newContext({ viewport });
const page = await context.newPage();
const consoleErrors = [];
page.on("console", (message) => message.type() === "error" && consoleErrors.push(message.text()));
page.on("pageerror", (error) => consoleErrors.push(String(error)));
if (apiKey) await page.addInitScript((key) => localStorage.setItem("voice-agent-api-key", key), apiKey);
if (scenario === "server-down") await page.route("**/api/session", (route) => route.abort("connectionrefused"));

// Record both audio levels every 20 ms from the page's own analysers (ms since Connect).
await page.addInitScript(() => {
  window.levelTrace = [];
});

const result = { scenario };
try {
  await page.goto(url);
  result.title = await page.title();
  const started = Date.now();
  await page.click("#connect");
  if (scenario === "conversation") {
    await page.evaluate(() => {
      const t0 = performance.now();
      const trace = () => {
        const agent = document.getElementById("agent-level").style.width;
        const user = document.getElementById("user-level").style.width;
        window.levelTrace.push([performance.now() - t0, parseFloat(user) || 0, parseFloat(agent) || 0]);
      };
      window.traceTimer = setInterval(trace, 20);
    });
    await page.waitForFunction(
      (turns) => {
        // Done when the last turn's reply has played out: the agent listening, silent, for 2 s.
        const lines = [...document.querySelectorAll("#transcript li")];
        const users = lines.filter((li) => li.classList.contains("user"));
        const last = lines[lines.length - 1];
        const settled =
          users.length >= turns && last.classList.contains("agent") &&
          document.getElementById("agent-state").dataset.state === "listening" &&
          (parseFloat(document.getElementById("agent-level").style.width) || 0) < 1;
        if (!settled) window.settledAt = null;
        else window.settledAt = window.settledAt || performance.now();
        return settled && performance.now() - window.settledAt > 2000;
      },
      userTurns,
      { timeout: timeoutMs, polling: 100 }
    ).catch((error) => (result.waitError = String(error)));
    result.trace = await page.evaluate(() => window.levelTrace);
  } else {
    await page.waitForSelector("#error:not([hidden])", { timeout: 15000 }).catch((e) => (result.waitError = String(e)));
  }
  result.seconds = (Date.now() - started) / 1000;
  result.transcript = await page.$$eval("#transcript li", (lines) =>
    lines.map((li) => ({ who: li.classList.contains("user") ? "user" : "agent", text: li.textContent, interrupted: li.classList.contains("interrupted") }))
  );
  result.latency = await page.textContent("#latency");
  result.error = await page.evaluate(() => {
    const el = document.getElementById("error");
    return el.hidden ? null : el.textContent;
  });
  result.status = await page.textContent("#status");
  result.agentState = await page.textContent("#agent-state");
  result.connectVisible = await page.isVisible("#connect");
  result.observed = await page.evaluate(() => window.voiceAgentDemo);
  if (screenshot) await page.screenshot({ path: screenshot, fullPage: true });
} catch (error) {
  result.failure = String(error);
}
result.consoleErrors = consoleErrors;
console.log(JSON.stringify(result));
// Stay in the room until the test has looked at the agent's side (one line on stdin), then leave.
if (options.hold) await new Promise((resolve) => process.stdin.once("data", resolve));
if (scenario === "conversation") await page.click("#disconnect").catch(() => {});
await browser.close();
process.exit(0);
