{{/* The objects' name: the release's (attnd-0, attnd-1, ... are then the pods). */}}
{{- define "attnd.fullname" -}}
{{- .Release.Name | trunc 52 | trimSuffix "-" -}}
{{- end -}}

{{- define "attnd.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "attnd.labels" -}}
{{ include "attnd.selectorLabels" . }}
app.kubernetes.io/component: attention-server
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The name TLS clients (probes, drains) verify. */}}
{{- define "attnd.serverName" -}}
{{- default (include "attnd.fullname" .) .Values.tls.serverName -}}
{{- end -}}

{{/* attnctl's TLS flags, as YAML list items, for the pod's own probes: it verifies the server
     name with the Secret's CA and, under mTLS, presents the pod's certificate. */}}
{{- define "attnd.attnctlTLS" -}}
"--tls-ca=/etc/attnd/tls/ca.crt", "--tls-server-name={{ include "attnd.serverName" . }}"
{{- if .Values.tls.clientAuth }}, "--tls-cert=/etc/attnd/tls/tls.crt", "--tls-key=/etc/attnd/tls/tls.key"{{ end }}
{{- end -}}
