"""The page's inline stylesheet and drawing script (kept as strings so the package needs no data files).

The script builds SVG as markup and assigns it with ``innerHTML``: the HTML
parser puts ``<svg>`` content in the SVG namespace by itself, so the page
needs no namespace URL and contains no URL at all.
"""

CSS = """
body{font:13px/1.4 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#222;background:#fafafa}
header{background:#263238;color:#fff;padding:10px 18px}header h1{margin:0;font-size:18px}
header .src{opacity:.7;font-size:12px}
section{margin:10px 18px;background:#fff;border:1px solid #ddd;border-radius:6px;padding:8px 12px}
h2{font-size:15px;margin:4px 0 8px}
.summary{display:flex;flex-wrap:wrap;gap:6px 18px}.kv span{color:#666;margin-right:6px}
.notes{margin:10px 18px;color:#8a4b00;background:#fff4e0;border:1px solid #f0c080;border-radius:6px;padding:6px 28px}
table.stages{border-collapse:collapse;font-variant-numeric:tabular-nums}
table.stages th,table.stages td{border-bottom:1px solid #e3e3e3;padding:3px 9px;text-align:right;white-space:nowrap}
table.stages th{background:#f1f3f4}
table.stages tr.bottleneck td{background:#ffe3e0;font-weight:600}
.sw{display:inline-block;width:10px;height:10px;border-radius:2px;margin-right:6px;vertical-align:middle}
.timelines{display:flex;flex-wrap:wrap;gap:12px}.tl{flex:1 1 100%;min-width:0;overflow-x:auto}
.tl h3{font-size:13px;margin:2px 0}.legend span{margin-right:14px;white-space:nowrap}
.toolbar{margin-bottom:6px}.toolbar button{margin-right:6px}#graph-info{color:#666;margin-left:8px}
#graph-wrap{overflow:auto;max-height:720px;border:1px solid #eee;background:#fcfcfc}
#graph .node{cursor:pointer}#graph .node:hover rect{stroke:#000;stroke-width:2}
#details{margin-top:6px;color:#333;font-family:ui-monospace,monospace;font-size:12px;white-space:pre-wrap}
"""

JS = r"""
(function(){
'use strict';
var D = JSON.parse(document.getElementById('fxpipe-data').textContent);
var PAL = D.palette;
function col(s){ return s < 0 ? '#cccccc' : PAL[s % PAL.length]; }
function esc(s){ return String(s).replace(/[&<>"]/g, function(c){
  return {'&':'&amp;','<':'&lt;','>':'&gt;','"':'&quot;'}[c]; }); }
function fs(x){ x = +(+x).toPrecision(3); if (!x) return '0'; var a = Math.abs(x);
  if (a >= 1) return x.toPrecision(3) + ' s'; if (a >= 1e-3) return (x*1e3).toPrecision(3) + ' ms';
  return (x*1e6).toPrecision(3) + ' µs'; }
function fb(n){ n = +n; var u = ['B','KiB','MiB','GiB','TiB'], i = 0;
  while (Math.abs(n) >= 1024 && i < u.length-1){ n /= 1024; i++; }
  return (i ? n.toPrecision(3) : Math.round(n)) + ' ' + u[i]; }

/* ---------------------------------------------------------------- timelines */
var KCOL = {F:'#8ab6e6', B:'#2f5f9e', wait:'#f6c6c0', allreduce:'#f28e2b', step:'#b07aa1',
            send_blocking:'#9e9e9e', comm:'#bdbdbd', other:'#d0d0d0'};
function legend(){
  var items = [['F','forward'],['B','backward'],['wait','waiting for a message'],['allreduce','all-reduce'],
               ['step','optimizer step']];
  var h = items.map(function(it){ return '<span><span class="sw" style="background:'+KCOL[it[0]]+'"></span>'+
    esc(it[1])+'</span>'; }).join('');
  h += '<span><svg width="22" height="8"><line x1="0" y1="4" x2="22" y2="4" stroke="#555" stroke-width="2"/></svg> send/recv (simulated: transfer in flight)</span>';
  document.getElementById('tl-legend').innerHTML = h;
}
/* waits on top of compute: a measured forward or backward that blocks on its input contains the wait */
function layer(kind){ return kind === 'wait' ? 1 : (kind === 'send' || kind === 'comm') ? 2 : 0; }
function spanOf(ranks){
  var T = 0; Object.keys(ranks).forEach(function(r){ ranks[r].forEach(function(e){ if (e[1] > T) T = e[1]; }); });
  return T;
}
function timeline(el, title, ranks, stageOf, note, T){
  var keys = Object.keys(ranks).map(Number).sort(function(a,b){return a-b;});
  var W = Math.max(560, el.clientWidth - 4), L = 86, lane = 26, top = 18;
  var H = top + keys.length * lane + 24, sx = (W - L - 10) / (T || 1);
  var s = ['<h3>'+esc(title)+'</h3>'];
  s.push('<svg width="'+W+'" height="'+H+'" font-size="10">');
  var ticks = 6;
  for (var i = 0; i <= ticks; i++){
    var t = T * i / ticks, x = L + t * sx;
    s.push('<line x1="'+x+'" y1="'+(top-4)+'" x2="'+x+'" y2="'+(H-20)+'" stroke="#eee"/>');
    s.push('<text x="'+x+'" y="'+(H-6)+'" text-anchor="'+(i === ticks ? 'end' : 'middle')+'" fill="#666">'+fs(t)+'</text>');
  }
  keys.forEach(function(r, k){
    var y = top + k * lane, st = stageOf ? stageOf[r] : undefined;
    s.push('<rect x="2" y="'+(y+3)+'" width="8" height="'+(lane-8)+'" fill="'+col(st === undefined ? -1 : st)+'"/>');
    s.push('<text x="14" y="'+(y+lane/2+3)+'" fill="#333">rank '+r+(st === undefined ? '' : ' · s'+st)+'</text>');
    var evs = ranks[r].slice().sort(function(a, b){ return layer(a[3]) - layer(b[3]); });
    evs.forEach(function(e){
      var x0 = L + e[0]*sx, w = Math.max((e[1]-e[0])*sx, 0.6), kind = e[3];
      var tip = '<title>rank '+r+' · '+esc(e[2])+' · '+fs(e[0])+' → '+fs(e[1])+' ('+fs(e[1]-e[0])+')</title>';
      if (kind === 'send' || kind === 'comm'){
        s.push('<line x1="'+x0+'" y1="'+(y+lane-4)+'" x2="'+(x0+w)+'" y2="'+(y+lane-4)+'" stroke="#555" stroke-width="2">'+tip+'</line>');
        return;
      }
      var c = KCOL[kind] || KCOL.other;
      s.push('<rect x="'+x0+'" y="'+(y+3)+'" width="'+w+'" height="'+(lane-10)+'" fill="'+c+'" stroke="#fff" stroke-width="0.5">'+tip+'</rect>');
      if (w > 16 && (kind === 'F' || kind === 'B'))
        s.push('<text x="'+(x0+w/2)+'" y="'+(y+lane/2+1)+'" text-anchor="middle" fill="'+(kind==='B'?'#fff':'#123')+'">'+esc(e[2])+'</text>');
    });
  });
  s.push('</svg>');
  if (note) s.push('<div class="src">'+esc(note)+'</div>');
  el.innerHTML = s.join('');
}
function drawTimelines(){
  legend();
  var sim = D.sim, simEl = document.getElementById('tl-sim'), mEl = document.getElementById('tl-measured');
  if (!D.measured) mEl.style.display = 'none';
  var Tmax = Math.max(spanOf(sim ? sim.ranks : {}), spanOf(D.measured ? D.measured.ranks : {}));
  if (sim) timeline(simEl, 'simulated: '+sim.kind+', '+sim.microbatches+
                    (sim.kind === '1f1b-stash' ? ' minibatches' : ' microbatches')+', step '+fs(sim.step_s)+
                    ', bubble '+(100*sim.bubble).toFixed(1)+' %', sim.ranks, sim.stage_of_rank,
                    'peak memory per rank: '+Object.keys(sim.peak_memory).map(function(r){
                      return 'r'+r+' '+fb(sim.peak_memory[r]); }).join(', '), Tmax);
  else simEl.innerHTML = '<p>no simulation</p>';
  if (D.measured) timeline(mEl, 'measured (Chrome trace' + (D.measured.note ? ', ' + D.measured.note : '') +
                           ', same time scale)', D.measured.ranks,
                           sim ? sim.stage_of_rank : null, '', Tmax);
}

/* ---------------------------------------------------------------- graph */
var G = D.graph, expanded = {};
function item(i){ var g = G.nodes[i].group; return expanded[g] ? 'n'+i : 'g'+g; }
function layout(){
  var items = {}, order = [], edges = {}, preds = {};
  G.nodes.forEach(function(n, i){ var id = item(i);
    if (!items[id]){ items[id] = {id:id, first:i, stage:n.stage}; order.push(id); } });
  G.edges.forEach(function(e){
    var a = item(e[0]), b = item(e[1]);
    if (a === b) return;
    var k = a+'>'+b, nu = G.nodes[e[0]], nv = G.nodes[e[1]];
    var cross = nu.stage !== nv.stage && !nu.input;
    if (!edges[k]) edges[k] = {a:a, b:b, cross:false, n:0};
    edges[k].cross = edges[k].cross || cross; edges[k].n++;
  });
  var E = Object.keys(edges).map(function(k){ return edges[k]; });
  E.forEach(function(e){ (preds[e.b] = preds[e.b] || []).push(e.a); });
  var layerOf = {}, layers = [];
  order.forEach(function(id){
    var l = 0; (preds[id] || []).forEach(function(p){
      if (layerOf[p] !== undefined && items[p].first < items[id].first) l = Math.max(l, layerOf[p] + 1); });
    layerOf[id] = l; (layers[l] = layers[l] || []).push(id);
  });
  var pos = {};
  layers.forEach(function(ids){ ids.forEach(function(id, k){ pos[id] = k; }); });
  for (var sweep = 0; sweep < 2; sweep++){
    layers.forEach(function(ids, l){
      if (!l) return;
      var bc = {};
      ids.forEach(function(id){ var ps = (preds[id] || []).filter(function(p){ return layerOf[p] < l; });
        bc[id] = ps.length ? ps.reduce(function(s,p){ return s + pos[p]; }, 0) / ps.length : pos[id]; });
      ids.sort(function(a,b){ return bc[a] - bc[b] || items[a].first - items[b].first; });
      ids.forEach(function(id, k){ pos[id] = k; });
    });
  }
  return {items:items, edges:E, layerOf:layerOf, pos:pos, layers:layers};
}
var fit = false, wrap = true;
function drawGraph(){
  var svg = document.getElementById('graph'), info = document.getElementById('graph-info');
  if (!G){ document.getElementById('graph-wrap').innerHTML =
    '<p style="padding:8px">No graph: this plan has no profile.json beside it. Show the folder written by <code>fxpipe split</code>, or pass <code>--profile</code>.</p>';
    info.textContent = ''; return; }
  var Lo = layout(), BW = 186, BH = 26, GX = 46, GY = 10, BAND_GAP = 34;
  var wrapW = Math.max(600, document.getElementById('graph-wrap').clientWidth - 30);
  var per = wrap ? Math.max(2, Math.floor((wrapW + GX) / (BW + GX))) : Lo.layers.length;
  var bands = Math.ceil(Lo.layers.length / per), bandRows = [], bandY = [0];
  Lo.layers.forEach(function(ids, l){ var b = Math.floor(l / per); bandRows[b] = Math.max(bandRows[b] || 0, ids.length); });
  for (var b = 0; b < bands; b++) bandY.push(bandY[b] + bandRows[b] * (BH + GY) + BAND_GAP);
  function xy(id){ var l = Lo.layerOf[id], b = Math.floor(l / per), rows = Lo.layers[l].length;
    return [10 + (l % per) * (BW + GX), 10 + bandY[b] + (Lo.pos[id] + (bandRows[b] - rows) / 2) * (BH + GY)]; }
  var W = 20 + Math.min(per, Lo.layers.length) * (BW + GX) - GX, H = 20 + bandY[bands] - BAND_GAP, s = [];
  for (var b2 = 1; b2 < bands; b2++) s.push('<line x1="0" x2="'+W+'" y1="'+(bandY[b2] - BAND_GAP/2 + 5)+'" y2="'+
    (bandY[b2] - BAND_GAP/2 + 5)+'" stroke="#e4e4e4" stroke-dasharray="2,4"/>');
  Lo.edges.forEach(function(e){
    var p = xy(e.a), q = xy(e.b), x1 = p[0] + BW, y1 = p[1] + BH/2, x2 = q[0], y2 = q[1] + BH/2, mx = (x1 + x2) / 2;
    s.push('<path d="M'+x1+','+y1+' C'+mx+','+y1+' '+mx+','+y2+' '+x2+','+y2+'" fill="none" '+
      (e.cross ? 'stroke="#d62728" stroke-width="2.2" stroke-dasharray="6,3"' : 'stroke="#9a9a9a" stroke-width="1" opacity="0.7"')+
      '>'+(e.cross ? '<title>communication: crosses a stage boundary</title>' : '')+'</path>');
  });
  Object.keys(Lo.items).forEach(function(id){
    var p = xy(id), it = Lo.items[id], isG = id[0] === 'g', label, tip;
    if (isG){ var g = G.groups[+id.slice(1)], f = 0, b = 0, pb = 0;
      g.members.forEach(function(i){ var n = G.nodes[i]; f += n.fwd; b += n.bwd; pb += n.params; });
      label = '⊞ ' + g.label; tip = g.label+(g.span ? '\n'+g.span : '')+'\nstage '+g.stage+'\n'+g.members.length+' nodes\nforward '+fs(f)+
        '\nbackward '+fs(b)+'\nparameters '+fb(pb)+'\nclick to expand';
    } else { var n = G.nodes[+id.slice(1)], kind = n.target.split('(')[0];
      label = n.name + (kind && kind !== n.name && n.op !== 'output' ? ' ' + kind : '');
      tip = n.name+' ('+n.op+')\n'+n.target+(n.module ? '\nmodule '+n.module : '')+'\nstage '+n.stage+
        '\nforward '+fs(n.fwd)+'\nbackward '+fs(n.bwd)+'\noutput '+fb(n.out)+'\nparameters '+fb(n.params); }
    var short = label.length > 30 ? label.slice(0, 29) + '…' : label;
    s.push('<g class="node" data-id="'+id+'"><title>'+esc(tip)+'</title><rect x="'+p[0]+'" y="'+p[1]+'" width="'+BW+
      '" height="'+BH+'" rx="'+(isG ? 7 : 3)+'" fill="'+col(it.stage)+'" fill-opacity="'+(isG ? 0.85 : 0.55)+
      '" stroke="'+(isG ? '#333' : '#777')+'" stroke-width="'+(isG ? 1.5 : 0.8)+'"/><text x="'+(p[0]+6)+'" y="'+
      (p[1]+BH/2+4)+'" font-size="11" fill="#111">'+esc(short)+'</text></g>');
  });
  svg.setAttribute('viewBox', '0 0 '+W+' '+H);
  svg.setAttribute('width', fit ? '100%' : W); svg.setAttribute('height', fit ? '' : H);
  if (fit) svg.removeAttribute('height');
  svg.innerHTML = s.join('');
  var shown = Object.keys(Lo.items).length;
  info.textContent = G.nodes.length+' nodes, '+G.edges.length+' edges, '+G.groups.length+' module groups; '+
    shown+' boxes shown; red dashed = communication between stages; hover for costs, click a group to expand';
}
function details(id){
  var el = document.getElementById('details');
  if (id[0] !== 'n') return;
  var n = G.nodes[+id.slice(1)], g = G.groups[n.group];
  el.textContent = n.name+'  op='+n.op+'  target='+n.target+'  module='+(n.module||'-')+'  stage='+n.stage+
    '  fwd='+fs(n.fwd)+'  bwd='+fs(n.bwd)+'  out='+fb(n.out)+'  params='+fb(n.params)+
    (g.members.length > 1 ? '   [group: '+g.label+'; double-click to collapse]' : '');
}
function stageLegend(){
  var h = [];
  for (var j = 0; j < D.stages; j++) h.push('<span><span class="sw" style="background:'+col(j)+'"></span>stage '+j+'</span>');
  var el = document.createElement('div'); el.className = 'legend'; el.innerHTML = h.join('');
  var wrap = document.getElementById('graph-wrap'); wrap.parentNode.insertBefore(el, wrap);
}
function init(){
  if (G && !G.collapsed) G.groups.forEach(function(g, k){ expanded[k] = true; });
  drawTimelines(); stageLegend(); drawGraph();
  var svg = document.getElementById('graph');
  svg.addEventListener('click', function(ev){
    var t = ev.target.closest('.node'); if (!t) return; var id = t.getAttribute('data-id');
    if (id[0] === 'g'){ expanded[+id.slice(1)] = true; drawGraph(); } else details(id); });
  svg.addEventListener('dblclick', function(ev){
    var t = ev.target.closest('.node'); if (!t) return; var id = t.getAttribute('data-id');
    if (id[0] === 'n'){ delete expanded[G.nodes[+id.slice(1)].group]; drawGraph(); } });
  document.getElementById('expand-all').onclick = function(){ if (!G) return;
    G.groups.forEach(function(g, k){ expanded[k] = true; }); drawGraph(); };
  document.getElementById('collapse-all').onclick = function(){ expanded = {}; drawGraph(); };
  document.getElementById('fit').onclick = function(){ fit = !fit; drawGraph(); };
  document.getElementById('wrap').onclick = function(){ wrap = !wrap; drawGraph(); };
}
init();
})();
"""
