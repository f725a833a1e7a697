#!/usr/bin/perl
# A strict checker of the Prometheus text exposition format 0.0.4, for the metrics test
# (Debian's promtool comes only with the whole prometheus package). Reads the text on stdin;
# exits 1 listing every violation. Checks: the text ends with a newline; metric and label names
# are valid; label values use only the \\ \" \n escapes; values are floats (NaN, +Inf, -Inf
# too) with an optional integer timestamp; TYPE is one of the five types, at most once per
# family and before its samples; HELP at most once; a family's samples are contiguous; no
# sample (name + labels) repeats; counters are named *_total and are never negative.
# And Prometheus' naming conventions (what `promtool check metrics` lints): gauges are not named
# *_total; base units only (seconds, bytes; no ms, msgs, kb, pct); one unit per metric, at the end
# of its name (before _total): `sent_bytes_total`, not `bytes_sent_total`.
use strict;
use warnings;

local $/;
my $text = <STDIN>;
my @err;
push @err, "empty exposition" if !defined $text || $text eq '';
push @err, "does not end with a newline" if defined $text && $text ne '' && $text !~ /\n\z/;
$text //= '';

my $name_re  = qr/[a-zA-Z_:][a-zA-Z0-9_:]*/;
my $label_re = qr/[a-zA-Z_][a-zA-Z0-9_]*/;
my $float_re = qr/(?:[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|[+-]?Inf|NaN)/;
my (%type, %help, %seen_sample, %done_family);
my $current = '';
my $ln = 0;
my $samples = 0;

# The family a sample belongs to: histograms and summaries add suffixes to the family name.
sub family_of {
  my ($n) = @_;
  for my $suffix ('_bucket', '_sum', '_count') {
    if ($n =~ /^(.*)\Q$suffix\E$/ && exists $type{$1} && $type{$1} =~ /^(histogram|summary)$/) {
      return $1;
    }
  }
  return $n;
}

for my $line (split /\n/, $text) {
  $ln++;
  next if $line eq '';
  if ($line =~ /^#/) {
    if ($line =~ /^# (HELP|TYPE) (\S+)(?: (.*))?$/) {
      my ($kind, $n, $rest) = ($1, $2, $3 // '');
      push @err, "line $ln: bad metric name '$n'" unless $n =~ /^$name_re$/;
      if ($kind eq 'TYPE') {
        push @err, "line $ln: unknown type '$rest'"
          unless $rest =~ /^(counter|gauge|histogram|summary|untyped)$/;
        push @err, "line $ln: second TYPE for $n" if exists $type{$n};
        push @err, "line $ln: TYPE for $n after its samples" if $seen_sample{"family:$n"};
        $type{$n} = $rest;
      } else {
        push @err, "line $ln: second HELP for $n" if exists $help{$n};
        push @err, "line $ln: bad escape in HELP" if $rest =~ /\\[^\\n]/;
        $help{$n} = $rest;
      }
      if ($n ne $current) {
        push @err, "line $ln: family $n appears again after other families" if $done_family{$n};
        $done_family{$current} = 1 if $current ne '';
        $current = $n;
      }
    }
    next;  # other comments are allowed
  }
  unless ($line =~ /^($name_re)(\{(.*)\})? ($float_re)(?: (-?\d+))?$/) {
    push @err, "line $ln: not a sample: '$line'";
    next;
  }
  my ($n, $labels, $value) = ($1, $3 // '', $4);
  $samples++;
  my $fam = family_of($n);
  if ($fam ne $current) {
    push @err, "line $ln: samples of $fam are not contiguous" if $done_family{$fam};
    $done_family{$current} = 1 if $current ne '';
    $current = $fam;
  }
  $seen_sample{"family:$fam"} = 1;
  my %names;
  my $rest = $labels;
  my @pairs;
  while ($rest ne '') {
    if ($rest =~ s/^($label_re)="((?:[^"\\\n]|\\[\\"n])*)"(,|$)//) {
      my ($k, $v) = ($1, $2);
      push @err, "line $ln: label $k twice" if $names{$k}++;
      push @err, "line $ln: reserved label name $k" if $k =~ /^__/;
      push @pairs, "$k=$v";
    } else {
      push @err, "line $ln: bad labels '{$labels}'";
      last;
    }
  }
  my $key = $n . '{' . join(',', sort @pairs) . '}';
  push @err, "line $ln: duplicate sample $key" if $seen_sample{$key}++;
  my $t = $type{$fam} // 'untyped';
  if ($t eq 'counter') {
    push @err, "line $ln: counter $n is not named *_total" unless $n =~ /_total$/;
    push @err, "line $ln: counter $n is negative ($value)" if $value =~ /^-/;
  }
}
my %unit = map { $_ => 1 } qw(seconds bytes);
my %not_base = map { $_ => 1 }
  qw(msg msgs ms us ns sec secs millis milliseconds microseconds nanoseconds minutes hours
     kb kib mb mib gb gib pct percent);
for my $n (sort keys %type) {
  push @err, "$n: a $type{$n} named *_total" if $type{$n} ne 'counter' && $n =~ /_total$/;
  (my $base = $n) =~ s/_total$//;
  my @parts = split /_/, $base;
  for my $i (0 .. $#parts) {
    push @err, "$n: '$parts[$i]' is not a base unit or is abbreviated" if $not_base{$parts[$i]};
    push @err, "$n: the unit '$parts[$i]' is not at the end of the name"
      if $unit{$parts[$i]} && $i != $#parts;
  }
}
push @err, "no samples" if $samples == 0;
if (@err) {
  print STDERR "$_\n" for @err;
  exit 1;
}
print "ok: $samples samples, " . scalar(keys %type) . " families\n";
