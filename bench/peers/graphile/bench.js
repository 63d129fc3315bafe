// Graphile Worker beside the outbox in the latency-versus-rate bench
// (bench/rates.go, -peers graphile). One open-loop run at one rate:
//
//   node bench.js --url URL --schema S --rate R --duration-ms D \
//     --producers P --concurrency C --drain-ms W
//
// The same rules as the Go modes (bench/latency.go): job i is due at
// start + i/rate whatever the previous commits took; P producer loops run
// one transaction each (BEGIN; add_job; COMMIT) on their own pool; the
// worker runs in this process, so the producer commit and the task start
// are read on one clock (performance.now(), monotonic). The job row's
// created_at (add_job's transaction) and locked_at (the fetch that locked
// it) are the database's clock, compared on the wall clock
// (performance.timeOrigin + performance.now()); node-postgres parses them
// with millisecond precision.
//
// Prints one JSON object on stdout; everything else goes to stderr.
"use strict";

const { performance } = require("node:perf_hooks");
const pg = require("pg");
const { run, runMigrations, Logger } = require("graphile-worker");

function parseArgs(argv) {
  const out = {};
  for (let i = 0; i < argv.length; i += 2) {
    const k = argv[i];
    if (!k.startsWith("--") || i + 1 >= argv.length) {
      throw new Error(`bad argument ${k}`);
    }
    out[k.slice(2)] = argv[i + 1];
  }
  for (const k of ["url", "schema", "rate", "duration-ms"]) {
    if (!out[k]) throw new Error(`missing --${k}`);
  }
  return {
    url: out.url,
    schema: out.schema,
    rate: Number(out.rate),
    durationMs: Number(out["duration-ms"]),
    // The rate is offered this long before the events measured; the
    // warmup's events are kept out of the percentiles (bench/latency.go).
    warmupMs: Number(out["warmup-ms"] || 0),
    producers: Number(out.producers || 8),
    concurrency: Number(out.concurrency || 16),
    drainMs: Number(out["drain-ms"] || 6000),
    // Events whose transaction has not begun this long after the start
    // are not sent (0: no cutoff).
    cutoffMs: Number(out["cutoff-ms"] || 0),
  };
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const wallNow = () => performance.timeOrigin + performance.now();
const us = (ms) => Math.round(ms * 1000);

async function main() {
  const o = parseArgs(process.argv.slice(2));
  const quiet = new Logger(() => (level, message) => {
    if (level === "error") process.stderr.write(`graphile-worker: ${message}\n`);
  });
  const warmN = Math.floor((o.rate * o.warmupMs) / 1000);
  const total = warmN + Math.floor((o.rate * o.durationMs) / 1000);
  const commit = new Float64Array(total).fill(NaN); // performance.now()
  const commitWall = new Float64Array(total).fill(NaN);
  const work = new Float64Array(total).fill(NaN);
  const created = new Float64Array(total).fill(NaN); // epoch ms, database clock
  const locked = new Float64Array(total).fill(NaN);
  let worked = 0;
  let lastWork = 0;

  await runMigrations({ connectionString: o.url, schema: o.schema, logger: quiet });
  const runner = await run({
    connectionString: o.url,
    schema: o.schema,
    concurrency: o.concurrency,
    maxPoolSize: o.concurrency + 2,
    pollInterval: 1000,
    noHandleSignals: true,
    logger: quiet,
    taskList: {
      bench: async (payload, helpers) => {
        const now = performance.now();
        const i = payload.i;
        if (!Number.isNaN(work[i])) return;
        work[i] = now;
        lastWork = now;
        created[i] = helpers.job.created_at ? new Date(helpers.job.created_at).getTime() : NaN;
        locked[i] = helpers.job.locked_at ? new Date(helpers.job.locked_at).getTime() : NaN;
        worked++;
      },
    },
  });
  const pool = new pg.Pool({ connectionString: o.url, max: o.producers });
  const addJob = `SELECT ${pg.escapeIdentifier(o.schema)}.add_job('bench', $1::json)`;
  try {
    // Open the producers' connections and let the worker settle.
    await Promise.all(
      Array.from({ length: o.producers }, async () => {
        const c = await pool.connect();
        await sleep(20);
        c.release();
      }),
    );
    await sleep(300);

    const txMs = [];
    const lagMs = [];
    const interval = 1000 / o.rate;
    const start = performance.now();
    let next = 0;
    let lastCommit = start;
    let published = 0;
    let notSent = 0;
    const producer = async () => {
      for (;;) {
        const i = next++;
        if (i >= total) return;
        if (o.cutoffMs > 0 && performance.now() - start - o.warmupMs > o.cutoffMs) {
          notSent++;
          continue;
        }
        const at = start + i * interval;
        const wait = at - performance.now();
        if (wait > 0) await sleep(wait);
        const begin = performance.now();
        const c = await pool.connect();
        try {
          await c.query("BEGIN");
          await c.query(addJob, [JSON.stringify({ i, order_id: 12345, amount_cents: 4200, currency: "EUR", note: "bench" })]);
          await c.query("COMMIT");
        } catch (err) {
          await c.query("ROLLBACK").catch(() => {});
          throw err;
        } finally {
          c.release();
        }
        const now = performance.now();
        commit[i] = now;
        commitWall[i] = wallNow();
        published++;
        if (i >= warmN) {
          txMs.push(now - begin);
          lagMs.push(begin - at);
        }
        if (now > lastCommit) lastCommit = now;
      }
    };
    await Promise.all(Array.from({ length: o.producers }, producer));

    const deadline = lastCommit + o.drainMs;
    while (worked < published && performance.now() < deadline) await sleep(5);

    const e2e = [];
    const fetch = [];
    const toWork = [];
    const warmE2e = [];
    let clamped = 0;
    const seg = (arr, d) => {
      if (Number.isNaN(d)) return;
      if (d < 0) clamped++;
      arr.push(us(d));
    };
    for (let i = 0; i < total; i++) {
      if (Number.isNaN(commit[i]) || Number.isNaN(work[i])) continue;
      if (i < warmN) {
        warmE2e.push(us(work[i] - commit[i]));
        continue;
      }
      seg(e2e, work[i] - commit[i]);
      seg(fetch, locked[i] - commitWall[i]);
      // locked_at → task start: both on the wall clock.
      seg(toWork, work[i] - commit[i] + commitWall[i] - locked[i]);
    }
    const elapsed = Math.max(lastCommit - start, o.warmupMs + o.durationMs);
    const result = {
      version: require("graphile-worker/package.json").version,
      node: process.version,
      events: total - warmN,
      warmup_events: warmN,
      warmup_end_to_end_us: warmE2e,
      published,
      not_sent: notSent,
      worked,
      achieved_rate: (published * 1000) / elapsed,
      drain_seconds: worked >= published ? Math.max(0, lastWork - lastCommit) / 1000 : -1,
      concurrency: o.concurrency,
      producers: o.producers,
      clamped_negative: clamped,
      end_to_end_us: e2e,
      commit_to_fetch_us: fetch,
      fetch_to_work_us: toWork,
      producer_tx_us: txMs.map(us),
      producer_lag_us: lagMs.map(us),
    };
    // Wait for the write to reach the pipe: process.exit right after a
    // write to a pipe drops what was not written yet (tens of kilobytes
    // of per-event times at 500 events/s), and the bench then reads a
    // truncated or empty result.
    await new Promise((resolve, reject) =>
      process.stdout.write(JSON.stringify(result) + "\n", (err) => (err ? reject(err) : resolve())),
    );
  } finally {
    await runner.stop().catch(() => {});
    await pool.end().catch(() => {});
  }
}

main().then(
  () => process.exit(0),
  (err) => {
    process.stderr.write(`graphile peer: ${err && err.stack ? err.stack : err}\n`);
    process.exit(1);
  },
);
