# ruff: noqa: E501  (HTML reads better unwrapped)
"""The dashboard's Jinja2 templates (autoescaped), kept in Python so that a
plain ``pip install`` ships them without package-data configuration."""

from __future__ import annotations

BASE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
{% if refresh %}<meta http-equiv="refresh" content="{{ refresh }}">{% endif %}
<title>{% block title %}tierckpt{% endblock %}</title>
<style>
  :root { color-scheme: light; }
  body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0;
         color: #1f2933; background: #f5f7fa; }
  header { background: #102a43; color: #fff; padding: 10px 24px; display: flex;
           gap: 24px; align-items: baseline; }
  header a { color: #bcccdc; text-decoration: none; }
  header .brand { color: #fff; font-weight: 700; font-size: 16px; }
  header .right { margin-left: auto; font-size: 12px; color: #9fb3c8; }
  main { padding: 16px 24px 40px; max-width: 1200px; }
  h1 { font-size: 20px; margin: 8px 0 12px; }
  h2 { font-size: 15px; margin: 24px 0 8px; color: #243b53; }
  table { border-collapse: collapse; background: #fff; width: 100%; }
  th, td { text-align: left; padding: 5px 10px; border-bottom: 1px solid #e4e7eb;
           vertical-align: top; }
  th { background: #f0f4f8; font-weight: 600; font-size: 12px; color: #486581; }
  td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
  .card { background: #fff; border: 1px solid #e4e7eb; border-radius: 6px; padding: 12px 16px; }
  .facts { display: flex; flex-wrap: wrap; gap: 12px; }
  .fact { background: #fff; border: 1px solid #e4e7eb; border-radius: 6px; padding: 8px 14px;
          min-width: 150px; }
  .fact .label { font-size: 11px; color: #627d98; text-transform: uppercase; }
  .fact .value { font-size: 18px; font-weight: 600; }
  .badge { display: inline-block; padding: 1px 7px; border-radius: 9px; font-size: 12px;
           font-weight: 600; color: #fff; background: #829ab1; white-space: nowrap; }
  .s-registered, .s-uploading, .s-pending, .s-retrying { background: #e0a800; color: #1f2933; }
  .s-durable, .s-committed, .s-replicated, .s-uploaded { background: #2e7d32; }
  .s-failed, .s-corrupt { background: #c62828; }
  .s-deleted, .s-none { background: #bdbdbd; color: #1f2933; }
  .warn { color: #b54708; font-weight: 600; }
  .bad { color: #c62828; font-weight: 600; }
  .ok { color: #2e7d32; font-weight: 600; }
  .muted { color: #829ab1; }
  .reason { font-family: ui-monospace, monospace; font-size: 12px; word-break: break-word; }
  svg { background: #fff; border: 1px solid #e4e7eb; border-radius: 6px; max-width: 100%;
        height: auto; }
  svg .plot, svg .lane { fill: #f8fafc; stroke: #e4e7eb; }
  svg .trend { fill: none; stroke: #9fb3c8; stroke-width: 1.5; }
  svg .grid { stroke: #e4e7eb; stroke-dasharray: 2 3; }
  svg .tick { font-size: 11px; fill: #627d98; }
  svg .axis-title { font-size: 12px; fill: #486581; font-weight: 600; }
  svg .lane-label { font-size: 12px; fill: #243b53; font-weight: 600; }
  svg .edge { fill: none; stroke: #78909c; stroke-width: 1.5; }
  svg .node { stroke: #263238; stroke-width: 1; }
  a { color: #2456a6; }
  form.login { max-width: 420px; }
  form.login input { width: 100%; padding: 6px; margin: 6px 0 10px; font: inherit; }
</style>
</head>
<body>
<header><a class="brand" href="/ui">tierckpt</a><a href="/ui">runs</a>
<span class="right">{{ node }} · {{ now_text }} UTC{% if can_logout %} ·
<a href="/ui/logout">sign out</a>{% endif %}</span></header>
<main>
{% block main %}{% endblock %}
</main>
</body>
</html>
"""

INDEX = """{% extends "base.html" %}
{% block title %}tierckpt · runs{% endblock %}
{% block main %}
<h1>Runs</h1>
<div class="facts">
  <div class="fact"><div class="label">runs</div><div class="value">{{ view.runs|length }}</div></div>
  <div class="fact"><div class="label">jobs queued / running</div>
    <div class="value">{{ queued }} / {{ running }}</div></div>
  <div class="fact"><div class="label">jobs retrying after errors</div>
    <div class="value {% if view.retrying %}warn{% endif %}">{{ view.retrying }}</div></div>
</div>
<h2>Runs and their recovery point</h2>
<p class="muted">Recovery point: how long ago the newest valid checkpoint was written, i.e. the
training lost if the run died now and restarted from it (per region: restarting there).</p>
<table id="runs">
<thead><tr><th>run</th><th class="num">checkpoints</th><th class="num">latest step</th>
<th class="num">latest valid</th><th>recovery point</th>
{% for region in regions %}<th>{{ region }}{% if loop.first %} (primary){% endif %}</th>{% endfor %}
<th class="num">pending copies</th><th class="num">problems</th></tr></thead>
<tbody>
{% for run in view.runs %}
{% set valid = run.latest_valid %}
<tr data-run="{{ run.name }}">
<td><a href="/ui/runs/{{ run.name }}">{{ run.name }}</a></td>
<td class="num">{{ run.checkpoints }}</td>
<td class="num">{{ run.latest_step if run.latest_step is not none else "-" }}</td>
<td class="num">{{ valid.step if valid else "-" }}</td>
<td>{% if valid %}<span class="{{ rpo_class(valid.created_at) }}">{{ ago(valid.created_at) }}</span>
{% else %}<span class="bad">no valid checkpoint</span>{% endif %}</td>
{% for region in regions %}{% set point = run.regions.get(region) %}
<td>{% if point %}<span class="{{ 'warn' if valid and point.step < valid.step else '' }}">step {{ point.step }}</span> · <span class="{{ rpo_class(point.created_at) }}">{{ ago(point.created_at) }}</span>
{% else %}<span class="muted">none</span>{% endif %}</td>{% endfor %}
<td class="num {% if run.pending %}warn{% endif %}">{{ run.pending }}</td>
<td class="num {% if run.problems %}bad{% endif %}">{{ run.problems }}</td>
</tr>
{% else %}
<tr><td colspan="{{ 7 + regions|length }}" class="muted">no runs yet</td></tr>
{% endfor %}
</tbody></table>
<h2>Regions</h2>
<table id="regions">
<thead><tr><th>region</th><th class="num">copies pending</th><th class="num">bytes pending</th>
<th>oldest waiting</th><th class="num">corrupt copies</th></tr></thead>
<tbody>
{% for region in view.regions %}
<tr data-region="{{ region.name }}"><td>{{ region.name }}{% if region.primary %} (primary){% endif %}</td>
<td class="num {% if region.pending %}warn{% endif %}">{{ region.pending }}</td>
<td class="num">{{ size(region.pending_bytes) }}</td>
<td>{{ duration(region.oldest_wait) if region.pending else "-" }}</td>
<td class="num {% if region.corrupt %}bad{% endif %}">{{ region.corrupt }}</td></tr>
{% endfor %}
</tbody></table>
{% if view.jobs %}
<h2>Background jobs</h2>
<table id="jobs"><thead><tr><th>kind</th><th>state</th><th class="num">count</th></tr></thead><tbody>
{% for (kind, state), count in view.jobs|dictsort %}
<tr><td>{{ kind }}</td><td>{{ state }}</td><td class="num">{{ count }}</td></tr>
{% endfor %}</tbody></table>
{% endif %}
{% endblock %}
"""

RUN = """{% extends "base.html" %}
{% block title %}tierckpt · {{ view.name }}{% endblock %}
{% block main %}
{% set valid = view.row.latest_valid %}
<h1>Run <span id="run-name">{{ view.name }}</span></h1>
<div class="facts">
  <div class="fact"><div class="label">latest valid step</div>
    <div class="value" id="latest-valid">{{ valid.step if valid else "none" }}</div></div>
  <div class="fact"><div class="label">recovery point</div>
    <div class="value {{ rpo_class(valid.created_at) if valid else 'bad' }}">{{ ago(valid.created_at) if valid else "-" }}</div></div>
  {% for region in view.regions %}{% set point = view.row.regions.get(region) %}
  <div class="fact" data-region="{{ region }}"><div class="label">restart in {{ region }}</div>
    <div class="value">{% if point %}<span class="{{ 'warn' if valid and point.step < valid.step else '' }}">step {{ point.step }}</span> <span class="{{ rpo_class(point.created_at) }}" style="font-size:13px">({{ ago(point.created_at) }})</span>{% else %}<span class="bad">nothing</span>{% endif %}</div></div>
  {% endfor %}
  <div class="fact"><div class="label">checkpoints</div><div class="value">{{ view.total }}</div></div>
  <div class="fact"><div class="label">pending copies</div>
    <div class="value {% if view.row.pending %}warn{% endif %}">{{ view.row.pending }}</div></div>
</div>

<h2>Timeline</h2>
{{ timeline }}
{% if view.total > view.checkpoints|length %}<p class="muted">newest {{ view.checkpoints|length }} of {{ view.total }} checkpoints</p>{% endif %}

<h2>Replication lag</h2>
<table id="lag"><thead><tr><th>region</th><th class="num">committed</th><th class="num">pending</th>
<th>oldest pending waiting</th><th>last lag</th><th>median lag (last 20)</th></tr></thead><tbody>
{% for lag in view.lags %}
<tr data-region="{{ lag.name }}"><td>{{ lag.name }}{% if lag.primary %} (primary){% endif %}</td>
<td class="num">{{ lag.committed }}</td>
<td class="num {% if lag.pending %}warn{% endif %}">{{ lag.pending }}</td>
<td>{% if lag.oldest_wait is not none %}<span class="warn">{{ duration(lag.oldest_wait) }}</span>{% else %}-{% endif %}</td>
<td>{{ duration(lag.last_lag) }}</td><td>{{ duration(lag.median_lag) }}</td></tr>
{% endfor %}</tbody></table>
<p class="muted">Lag: from the first durable copy to the copy in that region.</p>

<h2>Failures and retries</h2>
{% if view.failures %}
<table id="failures"><thead><tr><th>when (UTC)</th><th class="num">step</th><th>what</th><th>region</th>
<th>state</th><th class="num">attempts</th><th>reason</th></tr></thead><tbody>
{% for f in view.failures %}
<tr><td>{{ f.when.strftime("%Y-%m-%d %H:%M:%S") }}</td><td class="num">{{ f.step }}</td><td>{{ f.what }}</td>
<td>{{ f.region or "-" }}</td><td><span class="badge s-{{ f.state }}">{{ f.state }}</span></td>
<td class="num">{{ f.attempts if f.attempts is not none else "-" }}</td>
<td class="reason">{{ f.reason }}</td></tr>
{% endfor %}</tbody></table>
{% else %}<p class="ok" id="no-failures">no failures</p>{% endif %}

<h2>Lineage</h2>
{{ lineage }}

<h2>Checkpoints</h2>
<table id="checkpoints"><thead><tr><th class="num">step</th><th>state</th><th>registered (UTC)</th>
<th>durable after</th><th class="num">size</th>
{% for region in view.regions %}<th>{{ region }}</th>{% endfor %}<th>peers</th><th>parent</th><th>error</th></tr></thead><tbody>
{% for c in view.checkpoints %}
<tr id="step-{{ c.step }}" data-step="{{ c.step }}"><td class="num">{{ c.step }}</td>
<td><span class="badge s-{{ c.state }}">{{ c.state }}</span>{% if c.pinned %} 📌{% endif %}{% if c.quarantined %} <span class="bad">quarantined</span>{% endif %}</td>
<td>{{ c.created_at.strftime("%Y-%m-%d %H:%M:%S") }}</td>
<td>{{ duration((c.durable_at - c.created_at).total_seconds()) if c.durable_at else "-" }}</td>
<td class="num">{{ size(c.total_bytes) }}</td>
{% for region in view.regions %}{% set r = c.replicas.get(region) %}
<td data-region="{{ region }}" data-state="{{ r.state if r else 'none' }}">{% if r %}<span class="badge s-{{ r.state }}">{{ r.state }}</span>
{% if r.lag is not none and not loop.first %}<span class="muted">{{ "waiting " if r.state == "pending" else "" }}{{ duration(r.lag) }}</span>{% endif %}
{% if r.retrying %}<div class="reason warn">retrying (attempt {{ r.attempts }})</div>{% endif %}
{% else %}<span class="muted">-</span>{% endif %}</td>{% endfor %}
<td class="peers" data-peer-safe="{{ 'yes' if c.peer_safe else 'no' }}">{% for name, state in c.peers.items() %}<span class="badge s-{{ state }}" title="{{ state }}">{{ name }}</span> {% else %}<span class="muted">-</span>{% endfor %}{% if c.peer_safe %}<div class="muted">peer-safe</div>{% endif %}</td>
<td>{% if c.parent %}{{ c.parent[0] }}:{{ c.parent[1] }}{% else %}-{% endif %}</td>
<td class="reason">{{ c.error or "" }}</td></tr>
{% endfor %}</tbody></table>
{% endblock %}
"""

LOGIN = """{% extends "base.html" %}
{% block title %}tierckpt · sign in{% endblock %}
{% block main %}
<h1>Sign in</h1>
<form class="login card" method="get" action="{{ action }}">
<p>{{ message }}</p>
<label for="token">Token (role reader, trainer or admin)</label>
<input id="token" name="token" type="password" autocomplete="current-password" required>
<button type="submit">Open the dashboard</button>
<p class="muted">The token is kept in an HttpOnly cookie for this browser session only.
Scripts can send <code>Authorization: Bearer …</code> instead.</p>
</form>
{% endblock %}
"""

ERROR = """{% extends "base.html" %}
{% block title %}tierckpt · {{ heading }}{% endblock %}
{% block main %}
<h1>{{ heading }}</h1>
<p>{{ message }}</p>
<p><a href="/ui">back to the runs</a></p>
{% endblock %}
"""

TEMPLATES = {
    "base.html": BASE,
    "index.html": INDEX,
    "run.html": RUN,
    "login.html": LOGIN,
    "error.html": ERROR,
}
